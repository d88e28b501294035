"""Prompt log-probabilities (``echo``), several prompts per request and ``GET /health``
on a real head (demo-tiny), as lm-evaluation-harness, vLLM's clients and guidellm use
them; and the scoring itself against the model's own logits."""

from __future__ import annotations

import json
import math

import openai
import pytest
import torch
from fastapi.testclient import TestClient

from kvmesh.engine.scoring import prompt_logprobs

from .test_api import Head

CONTEXT = "Question: which cache survives a restart of the head?\nAnswer:"
CONTINUATION = " the one its peers keep"


@pytest.fixture(scope="module")
def head():
    h = Head("--no-publish", "--alias", "echo", "--max-queue", "4")
    yield h
    h.stop()


@pytest.fixture(scope="module")
def client(head):
    return openai.OpenAI(base_url=head.url + "/v1", api_key="unused")


def direct(engine, tokens: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position, one plain forward."""
    with torch.inference_mode():
        ids = torch.tensor([tokens], device=engine.device)
        logits = engine.model(input_ids=ids, logits_to_keep=0).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def post(head: Head, body: dict, path: str = "/v1/completions") -> dict:
    r = head.http.post(path, json={"model": "demo-tiny", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_scoring_equals_the_models_logits_in_any_chunking(tiny_engine):
    tokens = tiny_engine.encode(CONTEXT + CONTINUATION)
    lp = direct(tiny_engine, tokens)
    for chunk in (512, 7, 1):
        got = prompt_logprobs(tiny_engine, tokens, top=3, chunk=chunk)
        assert got[0] is None and len(got) == len(tokens)
        for i in range(1, len(tokens)):
            assert got[i].token == tokens[i]
            assert abs(got[i].logprob - lp[i - 1, tokens[i]].item()) < 1e-4, (chunk, i)
            best = torch.topk(lp[i - 1], 3)
            assert [t for t, _ in got[i].top] == best.indices.tolist()


def test_lm_eval_loglikelihood_request(head, tiny_engine):
    """lm-evaluation-harness's multiple-choice request: context + continuation,
    ``echo: true, logprobs: 1, max_tokens: 0``; it sums the continuation's logprobs
    and checks each is the greedy choice (the largest of ``top_logprobs``)."""
    prompt = CONTEXT + CONTINUATION
    out = post(head, {"prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 0})
    choice = out["choices"][0]
    tokens = tiny_engine.encode(prompt)
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"] == {
        "prompt_tokens": len(tokens),
        "completion_tokens": 0,
        "total_tokens": len(tokens),
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(tokens)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == prompt and lp["text_offset"][0] == 0
    ref = direct(tiny_engine, tokens)
    for i in range(1, len(tokens)):
        assert abs(lp["token_logprobs"][i] - ref[i - 1, tokens[i]].item()) < 1e-4
        top = lp["top_logprobs"][i]
        assert lp["tokens"][i] in top and 1 <= len(top) <= 2
        best = int(torch.argmax(ref[i - 1]))
        assert math.isclose(max(top.values()), ref[i - 1, best].item(), abs_tol=1e-4)
    # lm-eval's own arithmetic on the answer: the continuation's tokens
    ctxlen = len(tiny_engine.encode(CONTEXT))
    want = sum(ref[i - 1, tokens[i]].item() for i in range(ctxlen, len(tokens)))
    assert abs(sum(lp["token_logprobs"][ctxlen:]) - want) < 1e-3


def test_echo_with_generation_token_prompts_and_batches(head, tiny_engine):
    """lm-eval's defaults: token-id prompts, several per request, ``max_tokens: 1``;
    choice i is prompt i, its text the prompt then the answer, logprobs for both."""
    a = tiny_engine.encode(CONTEXT + CONTINUATION)
    b = tiny_engine.encode("A second, shorter prompt.")
    out = post(
        head,
        {"prompt": [a, b], "echo": True, "logprobs": 2, "max_tokens": 1, "temperature": 0},
    )
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for tokens, choice in zip((a, b), out["choices"], strict=True):
        single = post(head, {"prompt": tokens, "max_tokens": 1, "temperature": 0, "logprobs": 2})
        answer = single["choices"][0]
        prompt_text = tiny_engine.tokenizer.decode(tokens)
        assert choice["text"] == prompt_text + answer["text"]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(tokens) + 1
        assert lp["token_logprobs"][len(tokens)] == answer["logprobs"]["token_logprobs"][0]
        assert lp["text_offset"][len(tokens)] == len(prompt_text)
        ref = direct(tiny_engine, tokens)
        assert abs(lp["token_logprobs"][-2] - ref[-2, tokens[-1]].item()) < 1e-4
    assert out["usage"]["prompt_tokens"] == len(a) + len(b)
    assert out["usage"]["completion_tokens"] == 2


def test_prompt_lists_one_choice_per_prompt_and_n(client):
    prompts = ["The first prompt", "A second one, longer than the first", "Third"]
    out = client.completions.create(
        model="demo-tiny", prompt=prompts, n=2, max_tokens=3, temperature=0.8, seed=5
    )
    assert [c.index for c in out.choices] == list(range(6))
    for i, p in enumerate(prompts):
        alone = client.completions.create(
            model="demo-tiny", prompt=p, n=2, max_tokens=3, temperature=0.8, seed=5
        )
        assert [c.text for c in out.choices[2 * i : 2 * i + 2]] == [c.text for c in alone.choices]
    assert out.usage.prompt_tokens == sum(len(p.encode()) for p in prompts)
    assert out.usage.completion_tokens == 18
    # streamed: every choice's text arrives under its index and ends with a finish reason
    texts, finished = [""] * 6, [None] * 6
    for chunk in client.completions.create(
        model="demo-tiny", prompt=prompts, n=2, max_tokens=3, temperature=0.8, seed=5, stream=True
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            finished[c.index] = c.finish_reason or finished[c.index]
    assert texts == [c.text for c in out.choices] and all(finished)


def test_streamed_echo_starts_with_the_prompt(head):
    body = {"prompt": CONTEXT, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0}
    whole = post(head, body)["choices"][0]
    with head.http.stream(
        "POST", "/v1/completions", json={"model": "demo-tiny", **body, "stream": True}
    ) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(x[len("data: ") :])["choices"][0] for x in lines[:-1]]
    assert chunks[0]["text"] == CONTEXT and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    values = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert values == whole["logprobs"]["token_logprobs"]
    # echo alone, streamed: the prompt, then the finish
    only = post(head, {**body, "max_tokens": 0})["choices"][0]
    assert only["text"] == CONTEXT


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
        ({"prompt": ["a", "b", "c", "d", "e"], "max_tokens": 1}, "prompt"),  # > --max-queue
        ({"prompt": [[1, 2], []], "max_tokens": 1}, "prompt"),  # an empty one
        ({"prompt": [[1, 2], [100000]], "max_tokens": 1}, "prompt"),  # past the vocabulary
        ({"prompt": "x", "echo": "yes"}, "echo"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
    ],
)
def test_bad_prompts_and_echo_are_400s(head, body, param):
    r = head.http.post("/v1/completions", json={"model": "demo-tiny", **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    chat = {"model": "demo-tiny", "messages": [{"role": "user", "content": "x"}], "echo": True}
    r = head.http.post("/v1/chat/completions", json=chat)  # chat has no echo (as OpenAI)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_health_as_vllm_answers_it(head, tiny_engine, tmp_path):
    r = head.http.get("/health")
    assert r.status_code == 200 and r.content == b""
    # open as /healthz is, also when every OpenAI route needs a key
    from kvmesh.api.app import Limits, create_app
    from kvmesh.runtime.head import HeadRuntime

    keys = tmp_path / "keys"
    keys.write_text("secret-key\n")
    rt = HeadRuntime(tiny_engine, None, publish=False)
    try:
        app = create_app(rt, "demo-tiny", 4096, str(keys), limits=Limits(api_key_scope="all"))
        with TestClient(app) as c:
            assert c.get("/health").status_code == c.get("/healthz").status_code == 200
            assert c.get("/v1/models").status_code == 401
    finally:
        rt.close()
