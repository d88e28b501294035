"""OpenAI parameters on a real head (stop, logprobs, penalties, n), the stop-string
holdback, and the head's device and dtype choice.

The demo-tiny model is a byte-level model with random weights: its greedy text is
one character repeated ("Explain prefill caching" → "gggg…"), and a small
frequency penalty makes it move on to other characters ("ggggggOOOOO,,,,,,"),
which is what the stop-string tests cut.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import torch

from kvmesh.api.requests import MAX_N, MAX_STOPS, UNSUPPORTED
from kvmesh.engine import Decoded, Sampling, load_engine, pick_device, pick_dtype
from kvmesh.engine.base import StopScanner
from kvmesh.errors import ConfigError

from .test_api import Head

PROMPT = "Explain prefill caching"
MOVING = {"frequency_penalty": 0.1}  # greedy text that changes characters


@pytest.fixture(scope="module")
def head():
    h = Head("--no-publish", "--alias", "params")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(head):
    return openai.OpenAI(base_url=head.url + "/v1", api_key="unused")


def complete(head: Head, **body) -> dict:
    r = head.http.post("/v1/completions", json={"model": "demo-tiny", "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- the stop-string scanner -------------------------------------------------------


def test_stop_scanner_holds_back_a_possible_start_and_releases_it():
    s = StopScanner(["abc", "\n\n"])
    assert s.feed("xa") == 1  # "a" may start "abc"
    assert s.feed("b") == 1  # "ab" still may
    assert s.feed("d") == 4  # "abd" cannot: all shown
    assert s.feed("\n") == 4  # "\n" may start "\n\n"
    assert s.feed("y") == 6
    assert s.feed("ab") == 6 and s.cut is None
    assert s.feed("c") == 6 and s.cut == 6  # found: nothing from it on is shown
    assert s.feed("more") == 6 and s.text == "xabd\nyabc"


def test_stop_scanner_earliest_stop_wins_even_across_pieces():
    s = StopScanner(["world", "lo w"])
    assert s.feed("hel") == 2  # "l" may start "lo w"
    assert s.feed("lo wor") == 3 and s.cut == 3  # "lo w" starts before "world"
    s = StopScanner(["aa"])
    assert s.feed("baa") == 1 and s.cut == 1
    assert StopScanner([]).feed("anything") == 8
    assert StopScanner([""]).feed("empty stops are ignored") == 23


def test_engine_stop_cuts_text_and_stops_decoding(tiny_engine):
    e = tiny_engine
    state = e.prefill(e.encode(PROMPT))
    free = Decoded()
    s = Sampling(max_tokens=24, stop_on_eos=False, frequency_penalty=0.1)
    list(e.generate(e.fork(state), s, free))
    assert free.text.startswith("gggggg") and "O," in free.text, free.text
    cut = free.text.index("O,")
    out = Decoded()
    tokens = list(e.generate(e.fork(state), Sampling(**{**s.__dict__, "stop": ("O,", "zz")}), out))
    assert out.text == free.text[:cut] and out.stopped and out.finish_reason == "stop"
    assert tokens == free.tokens[: len(tokens)] and len(tokens) < len(free.tokens)
    assert out.shown == cut  # one byte per token: the tokens of the stop string are not shown


def test_defaults_and_logprobs_never_change_the_tokens(tiny_engine):
    e = tiny_engine
    state = e.prefill(e.encode(PROMPT))
    s = Sampling(max_tokens=12, temperature=1.0, seed=5, stop_on_eos=False)
    plain = list(e.generate(e.fork(state), s))
    out = Decoded()
    recorded = list(e.generate(e.fork(state), Sampling(**{**s.__dict__, "logprobs": 5}), out))
    assert recorded == plain == out.tokens and len(out.logprobs) == 12
    first = torch.log_softmax(state.logits.float(), -1)
    assert out.logprobs[0].logprob == pytest.approx(float(first[plain[0]]), abs=1e-6)
    assert [t for t, _ in out.logprobs[0].top] == torch.topk(first, 5).indices.tolist()


# -- stop ----------------------------------------------------------------------------


def test_stop_strings_non_streaming_and_streaming_agree(head, client):
    free = complete(head, max_tokens=24, temperature=0, ignore_eos=True, **MOVING)["choices"][0]
    cut = free["text"].index("O,")
    out = complete(head, max_tokens=24, temperature=0, stop=["O,", "zz"], **MOVING)
    c = out["choices"][0]
    assert c["text"] == free["text"][:cut] and c["finish_reason"] == "stop"
    assert "O," not in c["text"]
    stream = client.completions.create(
        model="demo-tiny",
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        stop="O,",
        stream=True,
        extra_body=MOVING,
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks) == c["text"]
    assert chunks[-1].choices[0].finish_reason == "stop"
    chat = client.chat.completions.create(
        model="demo-tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        temperature=0,
        stop=["O,"],
        frequency_penalty=0.1,
    )
    streamed = client.chat.completions.create(
        model="demo-tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=24,
        temperature=0,
        stop=["O,"],
        frequency_penalty=0.1,
        stream=True,
    )
    parts = list(streamed)
    assert (
        "".join(p.choices[0].delta.content or "" for p in parts) == chat.choices[0].message.content
    )
    assert "O," not in chat.choices[0].message.content
    # a stop string never produced changes nothing
    never = complete(head, max_tokens=24, temperature=0, ignore_eos=True, stop="QQQ", **MOVING)
    assert (
        never["choices"][0]["text"] == free["text"]
        and never["choices"][0]["finish_reason"] == "length"
    )


# -- logprobs ------------------------------------------------------------------------


def test_completions_logprobs_shape_and_values(head, tiny_engine):
    out = complete(head, max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    c = out["choices"][0]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == c["text"]
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    for tok, val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert val <= 0 and 3 <= len(top) <= 4
        assert max(top.values()) == val and top[tok] == val  # greedy: the sampled is the top-1
    logits = tiny_engine.prefill(tiny_engine.encode(PROMPT)).logits
    first = torch.log_softmax(logits.float(), -1)
    assert lp["token_logprobs"][0] == pytest.approx(float(first.max()), abs=1e-5)
    assert complete(head, max_tokens=2, temperature=0)["choices"][0]["logprobs"] is None


def test_chat_logprobs_shape_values_and_streaming(client):
    kw = {
        "model": "demo-tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 4,
        "extra_body": {"ignore_eos": True},
    }
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(t.token for t in content) == full.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        vals = [a.logprob for a in t.top_logprobs]
        assert len(vals) == 4 and vals == sorted(vals, reverse=True) and vals[0] == t.logprob
    streamed = [
        t
        for ch in client.chat.completions.create(**kw, stream=True)
        if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)
    plain = client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


# -- penalties -----------------------------------------------------------------------


def test_penalties_change_the_answer_and_are_range_checked(head):
    base = complete(head, max_tokens=16, temperature=0, ignore_eos=True)["choices"][0]["text"]
    for name in ("presence_penalty", "frequency_penalty"):
        assert (
            complete(head, max_tokens=16, temperature=0, ignore_eos=True, **{name: 1.0})["choices"][
                0
            ]["text"]
            != base
        )
        for bad in (-2.5, 2.01, "lots"):
            r = head.http.post(
                "/v1/completions", json={"model": "demo-tiny", "prompt": "x", name: bad}
            )
            assert r.status_code == 400 and r.json()["error"]["message"], r.text
    zero = complete(head, max_tokens=16, temperature=0, ignore_eos=True, presence_penalty=0)
    assert zero["choices"][0]["text"] == base


# -- n -------------------------------------------------------------------------------


def test_n_shares_one_prefill_and_choice_i_samples_with_seed_plus_i(head):
    out = complete(head, max_tokens=5, temperature=1.0, seed=7, n=3, ignore_eos=True)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    n_prompt = len(PROMPT.encode())
    assert out["usage"]["prompt_tokens"] == n_prompt
    assert out["usage"]["completion_tokens"] == 15
    for i, c in enumerate(out["choices"]):
        alone = complete(head, max_tokens=5, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert c["text"] == alone["choices"][0]["text"]
    greedy = complete(head, max_tokens=4, temperature=0, n=2)["choices"]
    assert greedy[0]["text"] == greedy[1]["text"]
    for bad in (0, MAX_N + 1):
        r = head.http.post("/v1/completions", json={"model": "demo-tiny", "prompt": "x", "n": bad})
        assert r.status_code == 400, r.text


def test_openai_client_n2_stop_logprobs_streaming_with_usage(client):
    kw = {
        "model": "demo-tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 20,
        "temperature": 0.7,
        "seed": 3,
        "n": 2,
        "stop": ["O,"],
        "logprobs": True,
        "top_logprobs": 2,
    }
    full = client.chat.completions.create(**kw)
    assert [c.index for c in full.choices] == [0, 1]
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = {0: "", 1: ""}
    lps: dict[int, list[float]] = {0: [], 1: []}
    finish = {}
    for ch in chunks:
        for c in ch.choices:
            text[c.index] += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                lps[c.index] += [t.logprob for t in c.logprobs.content]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in full.choices:
        assert text[c.index] == c.message.content
        assert finish[c.index] == c.finish_reason
        assert lps[c.index] == pytest.approx([t.logprob for t in c.logprobs.content], abs=1e-5)
    usage = chunks[-1].usage
    assert usage.prompt_tokens == full.usage.prompt_tokens
    assert usage.completion_tokens == full.usage.completion_tokens


# -- no-op values, still refused -----------------------------------------------------


# what common SDKs send by default: kvmesh implements none of these, and none changes the answer
NO_OPS = [
    {"best_of": 1},
    {"logit_bias": {}},
    {"response_format": {"type": "text"}},
    {"echo": False},
    {"suffix": ""},
    {"tools": []},
    {"functions": []},
    {"function_call": "auto"},
    {"top_k": -1},
    {"top_k": 0},
    {"min_p": 0},
    {"repetition_penalty": 1.0},
    {"min_tokens": 0},
    {"logit_bias": None},
    {"stream_options": None},
]


def test_no_op_values_are_accepted_and_change_nothing(head):
    base = {"max_tokens": 6, "temperature": 0.8, "seed": 11, "ignore_eos": True}
    plain = complete(head, **base)["choices"][0]["text"]
    for extra in NO_OPS:
        assert complete(head, **base, **extra)["choices"][0]["text"] == plain, extra
    # null is the default for OpenAI's nullable fields (temperature 1, top_p 1, n 1 ...)
    nulls = {
        k: None
        for k in ("top_p", "n", "presence_penalty", "frequency_penalty", "stream", "logprobs")
    }
    assert complete(head, **base, **nulls)["choices"][0]["text"] == plain
    default_t = complete(head, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True)
    assert complete(head, **{**base, "temperature": None})["choices"] == default_t["choices"]


def test_the_openai_sdk_defaults_pass_on_chat(client):
    kw = {
        "model": "demo-tiny",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5,
        "temperature": 0,
    }
    plain = client.chat.completions.create(**kw).choices[0].message.content
    same = client.chat.completions.create(
        **kw,
        response_format={"type": "text"},
        logit_bias={},
        extra_body={"best_of": 1, "top_k": -1},
    )
    assert same.choices[0].message.content == plain
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        client.chat.completions.create(**kw, stream_options={"include_usage": True})


BAD = [
    *[
        ({name: value}, name)
        for name, value in (
            ("logit_bias", {"1": 5}),
            ("logit_bias", []),
            ("tools", [{"type": "function"}]),
            ("functions", [{"name": "f"}]),
            ("function_call", {"name": "f"}),
            ("response_format", {"type": "xml"}),  # json ones: tests/test_tools.py
            ("response_format", "text"),
            ("best_of", 2),
            ("best_of", True),
            ("echo", "yes"),  # echo itself is served (tests/test_echo.py)
            ("suffix", "x"),
            ("top_k", 40),
            ("min_p", 0.1),
            ("repetition_penalty", 1.2),
            ("min_tokens", 3),
        )
    ],
    ({"best_of": 1, "n": 2}, "best_of"),  # OpenAI: best_of must be at least n
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # OpenAI: only with stream
    ({"stream_options": {}, "stream": False}, "stream_options"),
    ({"stop": ["a"] * (MAX_STOPS + 1)}, "stop"),
    ({"stop": ["x" * 4000] * 17}, "stop"),  # over MAX_STOP_TOTAL_CHARS in all
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"stop": 5}, "stop"),
]


def test_every_unsupported_parameter_is_listed():
    assert {b[1] for b in BAD} >= set(UNSUPPORTED)


@pytest.mark.parametrize("extra,param", BAD)
def test_unsupported_or_bad_parameters_are_400s(head, extra, param):
    r = head.http.post("/v1/completions", json={"model": "demo-tiny", "prompt": "x", **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (
        err["message"]
        and err["type"] == "invalid_request_error"
        and err["param"].split(".")[0] == param
    )


# OpenAI's ranges: outside is a 400 whatever the value (NaN and infinities are JSON here)
OUT_OF_RANGE = {
    "temperature": ["NaN", "Infinity", "-Infinity", "-0.001", "2.0001", "1e308", '"hot"', "[]"],
    "top_p": ["0", "-0.5", "1.0001", "NaN", "Infinity", "1e-400"],
    "presence_penalty": ["-2.0001", "2.0001", "NaN", "-Infinity"],
    "frequency_penalty": ["-2.0001", "2.0001", "NaN", "Infinity"],
    "n": ["0", "-1", str(MAX_N + 1), "1.5", "NaN"],
    "seed": ["-1", str(1 << 63), "0.5", "NaN"],
    "max_tokens": ["0", "-5", "40000", "1e400", "NaN"],
}


@pytest.mark.parametrize("name,raw", [(k, v) for k, vs in OUT_OF_RANGE.items() for v in vs])
def test_sampling_parameters_out_of_range_are_400s(head, name, raw):
    body = f'{{"model": "demo-tiny", "prompt": "x", "max_tokens": 2, "{name}": {raw}}}'
    for path in ("/v1/completions", "/v1/chat/completions"):
        if path.endswith("chat/completions"):
            body = body.replace('"prompt": "x"', '"messages": [{"role": "user", "content": "x"}]')
        r = head.http.post(path, content=body, headers={"Content-Type": "application/json"})
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["message"], r.text


def test_sampling_parameters_at_their_bounds_all_decode(head):
    """Every edge OpenAI accepts runs, and its logprobs are finite numbers."""
    edges = [{"temperature": t} for t in (0, 1e-40, 5e-324, 1e-5, 0.01, 2)]
    edges += [{"top_p": p} for p in (5e-324, 1e-9, 1)]
    edges += [{name: v} for name in ("presence_penalty", "frequency_penalty") for v in (-2, 2)]
    edges += [{"seed": 0}, {"seed": (1 << 63) - 1}, {"logprobs": 0}, {"logprobs": 20}]
    for extra in edges:
        out = complete(
            head, **{"max_tokens": 3, "ignore_eos": True, "logprobs": 2, "seed": 1, **extra}
        )
        lp = out["choices"][0]["logprobs"]
        assert out["usage"]["completion_tokens"] == 3, extra
        assert all(-1e4 <= v <= 0 for v in lp["token_logprobs"]), (extra, lp)


@pytest.mark.parametrize(
    "extra",
    [
        {"top_logprobs": 2},
        {"logprobs": True, "top_logprobs": 21},
        {"tools": [{"type": "function"}]},
        {"stream_options": {"include_usage": True}},
    ],
)
def test_chat_logprob_limits_are_400s(head, extra):
    body = {"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], **extra}
    r = head.http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text


# -- devices and dtypes ----------------------------------------------------------------


def test_device_choice():
    no, yes = (lambda: False), (lambda: True)
    assert pick_device("auto", cuda=no, mps=no) == "cpu"
    assert pick_device("auto", cuda=yes, mps=yes) == "cuda"
    assert pick_device("auto", cuda=no, mps=yes) == "mps"
    assert pick_device("cuda:1", cuda=yes, mps=no) == "cuda:1"
    with pytest.raises(ConfigError, match="CUDA is not available"):
        pick_device("cuda", cuda=no, mps=no)
    with pytest.raises(ConfigError, match="MPS is not available"):
        pick_device("mps", cuda=no, mps=no)
    with pytest.raises(ConfigError, match="unknown device"):
        pick_device("tpu")
    assert pick_device("auto", "mlx") is None
    with pytest.raises(ConfigError, match="mlx"):
        pick_device("cpu", "mlx")
    assert pick_dtype("auto") is None and pick_dtype("bfloat16") == "bfloat16"
    with pytest.raises(ConfigError, match="mlx"):
        pick_dtype("float16", "mlx")


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(), reason="CPU only"
)
def test_auto_on_this_cpu_is_cpu_float32_and_dtypes_are_namespaces():
    assert pick_device("auto") == "cpu"
    auto = load_engine("demo-tiny", device="auto", dtype="auto")
    assert auto.device.type == "cpu" and auto.card.kv_dtype == "float32"  # type: ignore[attr-defined]
    half = load_engine("demo-tiny", device="cpu", dtype="bfloat16")
    assert half.card.kv_dtype == "bfloat16"  # the card reads the real cache
    assert half.card.namespace != auto.card.namespace


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_head_device_cuda_without_cuda_is_a_clear_startup_error():
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "head", "--model", "demo-tiny", "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert "CUDA is not available" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "head", "--engine", "mlx", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "does not apply to the mlx engine" in r.stderr, r.stderr


def test_head_runs_the_device_and_dtype_it_is_told():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "head",
            "--model",
            "demo-tiny",
            "--listen",
            "127.0.0.1:0",
            "--no-publish",
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert " bfloat16 " in line and line.rstrip().endswith("device cpu"), line
        url = line.split()[3]
        out = httpx.post(
            url + "/v1/completions",
            json={"model": "demo-tiny", "prompt": PROMPT, "max_tokens": 2},
            timeout=60,
        ).json()
        assert out["usage"]["completion_tokens"] == 2
    finally:
        proc.terminate()
        proc.wait(15)


def test_fork_past_a_sliding_window_is_still_an_exact_independent_copy():
    from kvmesh.engine.hf import TransformersEngine

    from .zoo import SLIDING_WINDOW, hf_model, prompt_tokens

    path = hf_model("mistral")
    e = TransformersEngine(path)
    toks = prompt_tokens(path, SLIDING_WINDOW + 40)
    s = Sampling(max_tokens=6, temperature=1.0, seed=2, stop_on_eos=False)
    cold = list(e.generate(e.prefill(toks), s))
    state = e.prefill(toks)
    forks = [e.fork(state) for _ in range(2)]  # past the window: rebuilt from the record
    assert [list(e.generate(f, s)) for f in forks] == [cold, cold]
    assert list(e.generate(state, s)) == cold


def test_continuous_usage_stats_and_vllms_model_fields(head, client):
    """vLLM's ``stream_options.continuous_usage_stats``: usage so far on every chunk,
    growing with the tokens, and the last chunk's equals the final usage; and
    ``/v1/models`` carries vLLM's ``root``, ``parent`` and ``max_model_len``."""
    chunks = list(
        client.completions.create(
            model="demo-tiny",
            prompt=PROMPT,
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    done = [c.usage.completion_tokens for c in with_choices]
    assert done == sorted(done) and done[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    model = head.http.get("/v1/models").json()["data"][0]
    assert model["parent"] is None and model["root"] and model["max_model_len"] > 0
