"""xgrammar or llguidance: the grammar library behind constrained decoding, chosen
by measurement on this machine's CPUs (kvmesh/engine/grammar.py).

    python bench/grammar_choice.py --json bench/results/grammar_choice.json
    python bench/grammar_choice.py --smoke --json /tmp/grammar_choice.json   # tiny vocab only

Per library, vocabulary and grammar: the one-off tokenizer set-up (per model), the
compile time of the grammar (cold: a new compiler, nothing cached; llguidance's
includes building the matcher that kvmesh copies per sequence), and per decode step
the time to fill the next token's bitmask and to advance the matcher by one token,
over the tokens of a valid document (mean, p50, p99): the first sequence (cold) and
the next ones (warm). ``kvmesh``: what kvmesh.engine.grammar adds per step on top
of llguidance (the mask as a bool per logit, EOS swapped in); ``apply``: setting
the disallowed logits to -inf (torch and NumPy), the same whichever library.

xgrammar is not a dependency of kvmesh: without it (``pip install xgrammar`` to
compare) its rows say so and the rest runs.

Vocabularies: ``tiny``, the test zoo's qwen2 tokenizer (512 entries); ``real``, the
Tekken tokenizer of Mistral NeMo (131,072 entries, byte-level BPE), rebuilt as a
Hugging Face tokenizer from the vocabulary that the ``mistral_common`` package ships
(found in this environment or in ``.venv-vllm``; the row is skipped without it).
"""

from __future__ import annotations

import argparse
import base64
import glob
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHOSEN = "llguidance"
WHY = (
    "per-step masks within microseconds of xgrammar's (both far below a decode forward); "
    "compiling a new schema ~1-2 ms against 30-45 ms (on the TTFT of every new schema); "
    "no dependencies (xgrammar needs torch and triton); its one cost: 2.6 s tokenizer set-up "
    "once per model and process at 131k tokens (kvmesh.engine.grammar.prepare)"
)
sys.path.insert(0, str(ROOT / "tests"))

# the shape: a string enum, an integer, an array of strings, required keys
SMALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["color", "count", "tags"],
    "additionalProperties": False,
}
SMALL_DOC = {"color": "green", "count": 42, "tags": ["alpha", "beta gamma", "delta"]}

# an agent's tool call: nested objects, arrays of objects, enums, numbers, optional keys
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "path": {"type": "string", "description": "file to edit"},
        "edits": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "line": {"type": "integer", "minimum": 1},
                    "action": {"type": "string", "enum": ["insert", "replace", "delete"]},
                    "text": {"type": "string"},
                    "confidence": {"type": "number"},
                },
                "required": ["line", "action"],
                "additionalProperties": False,
            },
        },
        "reason": {"type": "string"},
        "dry_run": {"type": "boolean"},
        "labels": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["path", "edits"],
    "additionalProperties": False,
}
TOOL_DOC = {
    "path": "kvmesh/engine/base.py",
    "edits": [
        {"line": 12, "action": "replace", "text": "return x + 1", "confidence": 0.9},
        {"line": 40, "action": "delete"},
        {"line": 41, "action": "insert", "text": "# the mask acts after the forward"},
    ],
    "reason": "constrained decoding needs a hook before sampling",
    "dry_run": False,
    "labels": ["grammar", "engine"],
}


def tiny_tokenizer() -> Any:
    import zoo
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(zoo.hf_model("qwen2")))


def _tekken_file() -> Path | None:
    try:
        import mistral_common

        cands = glob.glob(str(Path(mistral_common.__file__).parent / "data" / "tekken_*.json"))
    except ImportError:
        cands = glob.glob(
            str(ROOT / ".venv-vllm/lib/python*/site-packages/mistral_common/data/tekken_*.json")
        )
    return Path(sorted(cands)[-1]) if cands else None


def real_tokenizer() -> Any:
    """Mistral NeMo's Tekken (131,072 entries: 1,000 special, then byte-level BPE),
    as a Hugging Face fast tokenizer (cached under $KVMESH_HOME/bench)."""
    from transformers import PreTrainedTokenizerFast

    home = Path(os.environ.get("KVMESH_HOME", Path.home() / ".cache" / "kvmesh"))
    out = home / "bench" / "tekken-hf"
    if not (out / "tokenizer.json").exists():
        src = _tekken_file()
        if src is None:
            return None
        _build_tekken(src, out)
    return PreTrainedTokenizerFast(tokenizer_file=str(out / "tokenizer.json"), eos_token="</s>")


def _build_tekken(src: Path, out: Path) -> None:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    d = json.loads(src.read_text())
    n_special = d["config"]["default_num_special_tokens"]
    n_bytes = d["config"]["default_vocab_size"] - n_special
    ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in d["vocab"][:n_bytes]}
    enc = bytes_to_unicode()

    def s(b: bytes) -> str:
        return "".join(enc[c] for c in b)

    vocab = {s(b): n_special + r for b, r in ranks.items()}
    merges = []
    for b, r in ranks.items():
        for i in range(1, len(b)):
            if b[:i] in ranks and b[i:] in ranks:
                merges.append((r, ranks[b[:i]], ranks[b[i:]], s(b[:i]), s(b[i:])))
    merges.sort()
    tok = Tokenizer(BPE(vocab, [(m[3], m[4]) for m in merges], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(d["config"]["pattern"]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<unk>", "<s>", "</s>"] + [f"<SPECIAL_{i}>" for i in range(3, n_special)]
    # specials take ids 0..999: put them first by rebuilding the vocabulary around them
    tok.add_special_tokens([AddedToken(t, special=True) for t in specials])
    data = json.loads(tok.to_str())
    for i, a in enumerate(data["added_tokens"]):
        a["id"] = i
    for t in specials:
        data["model"]["vocab"][t] = specials.index(t)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tokenizer.json.tmp"
    tmp.write_text(json.dumps(data))
    tmp.replace(out / "tokenizer.json")


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    return {
        "mean_us": statistics.fmean(xs) * 1e6,
        "p50_us": xs[len(xs) // 2] * 1e6,
        "p99_us": xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6,
        "max_us": xs[-1] * 1e6,
    }


WARM_RUNS = 2


def _summary(compile_s: float, runs: list[Any], steps: int) -> dict[str, Any]:
    """The first sequence (cold: a new process's first use of the grammar) apart from
    the next ones (warm: what every later request with the same grammar sees)."""
    warm = runs[1:]
    return {
        "compile_ms": compile_s * 1e3,
        "cold_first_mask_ms": runs[0][0] * 1e3,
        "cold_mask": _stats(runs[0][1]),
        "warm_first_mask_ms": min(r[0] for r in warm) * 1e3,
        "warm_mask": _stats([x for r in warm for x in r[1]]),
        "warm_advance": _stats([x for r in warm for x in r[2]]),
        "steps": steps,
        "complete": all(r[4] for r in runs),
    }


def bench_apply(vocab: int) -> dict[str, Any]:
    """kvmesh's own mask application, the same whichever library fills the bitmask:
    unpack the 32-bit words to one bool per token (NumPy), then ``np.where`` on the
    float32 logits (the torch engine on the CPU; ``torch.where``, its path on a GPU,
    for comparison: on 2 busy cores torch's thread pool can stall it for ms) or on
    the float64 copy (the mlx engine)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(0)
    words = (vocab + 31) // 32
    out: dict[str, Any] = {}
    logits = torch.randn(vocab)
    x = logits.numpy().astype(np.float64)
    neg = torch.tensor(float("-inf"))
    for name, allowed in (
        ("structure", np.zeros(vocab, bool)),  # a few tokens allowed (JSON punctuation)
        ("string", np.ones(vocab, bool)),  # almost all allowed (inside a string)
    ):
        allowed[rng.integers(0, vocab, 64)] = not allowed[0]
        bits = np.packbits(allowed, bitorder="little").view(np.int32)[:words]
        unpack, where_t, where_32, where_64 = [], [], [], []
        for _ in range(200):
            t = time.perf_counter()
            a = np.unpackbits(bits.view(np.uint8), count=vocab, bitorder="little").view(bool)
            t2 = time.perf_counter()
            torch.where(torch.from_numpy(a), logits, neg)
            t3 = time.perf_counter()
            torch.from_numpy(np.where(a, logits.numpy(), np.float32(-np.inf)))
            t4 = time.perf_counter()
            np.where(a, x, -np.inf)
            t5 = time.perf_counter()
            unpack.append(t2 - t)
            where_t.append(t3 - t2)
            where_32.append(t4 - t3)
            where_64.append(t5 - t4)
        out[name] = {
            "unpack": _stats(unpack),
            "torch_where": _stats(where_t),
            "numpy_where_float32": _stats(where_32),
            "numpy_where_float64": _stats(where_64),
        }
    return out


def bench_xgrammar(tok: Any, grammars: dict[str, tuple[str, Any, list[int]]]) -> dict[str, Any]:
    import torch
    import xgrammar as xgr

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    setup = time.perf_counter() - t
    out: dict[str, Any] = {"version": xgr.__version__ if hasattr(xgr, "__version__") else "?"}
    out["tokenizer_setup_ms"] = setup * 1e3
    for name, (kind, src, doc) in grammars.items():
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        t = time.perf_counter()
        if kind == "json_schema":
            cg = compiler.compile_json_schema(json.dumps(src), strict_mode=True)
        elif kind == "json_object":
            cg = compiler.compile_builtin_json_grammar()
        else:
            cg = compiler.compile_regex(src)
        compile_s = time.perf_counter() - t
        bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
        logits = torch.zeros(1, info.vocab_size)
        runs = []
        for _ in range(WARM_RUNS + 1):  # a new matcher of the same compiled grammar each time
            t = time.perf_counter()
            m = xgr.GrammarMatcher(cg)
            m.fill_next_token_bitmask(bitmask)
            first = time.perf_counter() - t
            masks, advances, apply = [], [], []
            for i, tid in enumerate(doc):
                t = time.perf_counter()
                if i:
                    m.fill_next_token_bitmask(bitmask)
                t2 = time.perf_counter()
                ok = m.accept_token(tid)
                t3 = time.perf_counter()
                assert ok, f"xgrammar refused token {i} of {name}"
                if i:
                    masks.append(t2 - t)
                advances.append(t3 - t2)
                t = time.perf_counter()
                xgr.apply_token_bitmask_inplace(logits, bitmask)
                apply.append(time.perf_counter() - t)
            m.fill_next_token_bitmask(bitmask)
            complete = bool(m.is_terminated() or m.accept_token(tok.eos_token_id))
            runs.append((first, masks, advances, apply, complete))
        out[name] = _summary(compile_s, runs, len(doc))
        out[name]["xgrammar_apply_inplace"] = _stats([a for r in runs[1:] for a in r[3]])
    return out


def bench_llguidance(tok: Any, grammars: dict[str, tuple[str, Any, list[int]]]) -> dict[str, Any]:
    import llguidance as llg
    import llguidance.hf
    import llguidance.numpy as lnp

    t = time.perf_counter()
    lt = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    setup = time.perf_counter() - t
    out: dict[str, Any] = {"version": llg.get_version() if hasattr(llg, "get_version") else "?"}
    out["tokenizer_setup_ms"] = setup * 1e3
    for name, (kind, src, doc) in grammars.items():
        t = time.perf_counter()
        if kind == "json_schema":
            g = llg.LLMatcher.grammar_from_json_schema(src)
        elif kind == "json_object":
            g = llg.LLMatcher.grammar_from_json_schema({"type": "object"})
        else:
            g = llg.LLMatcher.grammar_from_regex(src)
        err = llg.LLMatcher.validate_grammar(g, lt)
        assert not err, err
        compile_s = time.perf_counter() - t
        bitmask = lnp.allocate_token_bitmask(1, lt.vocab_size)
        t = time.perf_counter()
        template = llg.LLMatcher(lt, g, log_level=0)  # as kvmesh does: one per grammar
        compile_s += time.perf_counter() - t
        runs = []
        for _ in range(WARM_RUNS + 1):  # each sequence a deep copy of the template
            t = time.perf_counter()
            m = template.deep_copy()
            lnp.fill_next_token_bitmask(m, bitmask)
            first = time.perf_counter() - t
            masks, advances = [], []
            for i, tid in enumerate(doc):
                t = time.perf_counter()
                if i:
                    lnp.fill_next_token_bitmask(m, bitmask)
                t2 = time.perf_counter()
                ok = m.consume_token(tid)
                t3 = time.perf_counter()
                assert ok, f"llguidance refused token {i} of {name}: {m.get_error()}"
                if i:
                    masks.append(t2 - t)
                advances.append(t3 - t2)
            lnp.fill_next_token_bitmask(m, bitmask)
            runs.append((first, masks, advances, [], bool(m.is_accepting())))
        out[name] = _summary(compile_s, runs, len(doc))
    return out


def bench_kvmesh(tok: Any, grammars: dict[str, tuple[str, Any, list[int]]]) -> dict[str, Any]:
    """What kvmesh.engine.grammar adds to a decode step (llguidance under it): the
    matcher's ``allowed()`` (bitmask, unpacked to a bool per logit, EOS swapped in)
    and ``advance()``, warm; and the first compile of each spec for this tokenizer."""
    from kvmesh.engine.grammar import GrammarSpec, compile_grammar, prepare

    t = time.perf_counter()
    prepare(tok)
    out: dict[str, Any] = {"tokenizer_setup_ms": (time.perf_counter() - t) * 1e3}
    eos = [tok.eos_token_id]
    for name, (kind, src, doc) in grammars.items():
        t = time.perf_counter()
        spec = {
            "json_schema": lambda: GrammarSpec.json_schema(src),
            "json_object": GrammarSpec.json_object,
            "regex": lambda: GrammarSpec.regex(src),
        }[kind]()
        compiled = compile_grammar(tok, spec)
        compile_s = time.perf_counter() - t
        steps: list[float] = []
        for _ in range(WARM_RUNS + 1):
            m = compiled.matcher()
            one: list[float] = []
            for tid in doc:
                t = time.perf_counter()
                allowed = m.allowed(len(tok), eos)
                m.advance(tid)
                one.append(time.perf_counter() - t)
                assert allowed[tid]
            steps = one if not steps else steps + one
        out[name] = {
            "spec_and_compile_ms": compile_s * 1e3,
            "allowed_and_advance": _stats(steps[len(doc) :]),  # the warm runs
        }
    return out


def grammars_for(tok: Any) -> dict[str, tuple[str, Any, list[int]]]:
    def ids(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    return {
        "small_schema": ("json_schema", SMALL_SCHEMA, ids(json.dumps(SMALL_DOC))),
        "tool_schema": ("json_schema", TOOL_SCHEMA, ids(json.dumps(TOOL_DOC))),
        "json_object": ("json_object", None, ids(json.dumps(TOOL_DOC))),
        "regex": ("regex", r"\d{3}-[a-z]{2}", ids("123-ab")),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--smoke", action="store_true", help="the tiny vocabulary only")
    args = ap.parse_args()
    vocabs: dict[str, Any] = {"tiny": tiny_tokenizer()}
    if not args.smoke:
        t = time.perf_counter()
        real = real_tokenizer()
        if real is not None:
            vocabs["real"] = real
            print(f"real vocabulary ready in {time.perf_counter() - t:.1f}s", file=sys.stderr)
    result: dict[str, Any] = {
        "machine": platform.machine(),
        "cpu": _cpu(),
        "threads": os.cpu_count(),
        "load_average_at_start": os.getloadavg()[0],  # other work on the same cores
        "vocabularies": {k: len(v) for k, v in vocabs.items()},
        "chosen": CHOSEN,
        "why": WHY,
        "results": {},
    }
    for vname, tok in vocabs.items():
        grammars = grammars_for(tok)
        row: dict[str, Any] = {}
        for lib, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
            if importlib.util.find_spec(lib) is None:  # xgrammar is no dependency of kvmesh
                row[lib] = {"skipped": f"{lib} is not installed (pip install {lib})"}
                continue
            row[lib] = fn(tok, grammars)
            print(vname, lib, json.dumps(row[lib], indent=None)[:600], file=sys.stderr)
        row["kvmesh"] = bench_kvmesh(tok, grammars)
        row["apply"] = bench_apply(len(tok))
        result["results"][vname] = row
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
