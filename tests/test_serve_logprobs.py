"""`engram serve`'s `logprobs` and `echo` on /v1/completions (OpenAI's legacy shape, as vLLM answers it), token-id
prompts, and vLLM's /tokenize, /detokenize, /tokenizer_info: driven in process (FastAPI's TestClient) on a tiny
random engram model and a tiny Llama base with an Engram adapter (test_dtype_device's folders)."""

import math

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("transformers")

from fastapi.testclient import TestClient  # noqa: E402
from test_dtype_device import folders  # noqa: E402, F401  (the module fixture: model, base + adapter folders)

from engram.inference import load_inference_model  # noqa: E402
from engram.serving import load_engine  # noqa: E402
from engram.serving.app import create_app  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog, line 3"
KINDS = ["model", "pair"]


def source(folders, kind):  # noqa: F811
    return dict(path=folders / "model") if kind == "model" else dict(base=folders / "base",
                                                                     adapter=folders / "adapter")


@pytest.fixture(scope="module")
def served(folders):  # noqa: F811
    """{kind: (TestClient, the same model loaded directly, its tokenizer)}; engines closed at the end."""
    out, engines = {}, []
    for kind in KINDS:
        engine = load_engine(**source(folders, kind), name="tiny")
        engines.append(engine)
        model, tok = load_inference_model(**source(folders, kind))
        out[kind] = (TestClient(create_app(engine)), model.eval(), tok)
    yield out
    for e in engines:
        e.close()


def complete(client, **kw):
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "temperature": 0, **kw})
    assert r.status_code == 200, r.json()
    return r.json()["choices"][0]


@pytest.mark.parametrize("kind", KINDS)
def test_echo_with_no_new_tokens_equals_a_direct_forwards_log_softmax(served, kind):
    """max_tokens 0 + echo (how lm-eval scores a continuation): each prompt token's logprob and top-k, within
    1e-5 of log_softmax over a forward of the model loaded directly (float32); the first token has None."""
    client, model, tok = served[kind]
    ids = tok.encode(PROMPT, add_special_tokens=False).ids
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0].float(), dim=-1)  # (T, V)
    want = lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    for prompt in (PROMPT, ids):  # text, and the same prompt as token ids
        c = complete(client, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
        got = c["logprobs"]
        assert c["text"] == PROMPT and c["finish_reason"] == "length"
        assert got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
        assert torch.allclose(torch.tensor(got["token_logprobs"][1:]), want, atol=1e-5, rtol=0)
        for j, top in enumerate(got["top_logprobs"][1:]):
            best = lp[j].topk(3).values
            # k + the chosen one, fewer where two ids spell one text (byte tokens shown as "\ufffd")
            assert 1 <= len(top) <= 4 and abs(max(top.values()) - float(best[0])) < 1e-5
            assert got["tokens"][j + 1] in top


def test_the_legacy_shape_with_echo_and_new_tokens(served):
    client, _, tok = served["model"]
    c = complete(client, max_tokens=4, echo=True, logprobs=2)
    lp = c["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    n_prompt = len(tok.encode(PROMPT, add_special_tokens=False).ids)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert len(lp["tokens"]) == n_prompt + 4 and c["text"].startswith(PROMPT)
    assert lp["text_offset"][0] == 0 and lp["text_offset"][n_prompt] == len(PROMPT)
    assert "".join(lp["tokens"]) == c["text"]  # (this text has no character split over tokens)
    assert all(lp["text_offset"][j + 1] - lp["text_offset"][j] == len(t) for j, t in enumerate(lp["tokens"][:-1]))
    assert all(v <= 0 and math.isfinite(v) for v in lp["token_logprobs"][1:])


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_logprobs_name_the_greedy_tokens(served, kind):
    """Sampling off: each generated token is the likeliest one (its logprob is its row's maximum), and asking for
    logprobs changes nothing in the text."""
    client, _, _ = served[kind]
    plain = complete(client, max_tokens=10)
    c = complete(client, max_tokens=10, logprobs=1)
    lp = c["logprobs"]
    assert c["text"] == plain["text"] and len(lp["tokens"]) == 10
    for chosen, tok, top in zip(lp["token_logprobs"], lp["tokens"], lp["top_logprobs"]):
        assert top[tok] == chosen and chosen == max(top.values())
    assert lp["text_offset"][0] == 0


def test_token_id_prompts_and_the_tokenizer_routes(served):
    client, _, tok = served["model"]
    ids = client.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}).json()
    assert ids["tokens"] == tok.encode(PROMPT, add_special_tokens=False).ids and ids["count"] == len(ids["tokens"])
    assert client.post("/detokenize", json={"tokens": ids["tokens"]}).json() == {"prompt": PROMPT}
    info = client.get("/tokenizer_info").json()
    assert info["eos_token"] == "<|endoftext|>" and info["bos_token"] is None and info["model_max_length"] > 0
    # the same prompt as ids, alone or in a list of one: the same answer
    for prompt in (ids["tokens"], [ids["tokens"]]):
        assert complete(client, prompt=prompt, max_tokens=6)["text"] == complete(client, max_tokens=6)["text"]


def test_streaming_echo_starts_with_the_prompt(served):
    client, _, _ = served["model"]
    with client.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 5,
                                                        "temperature": 0, "echo": True, "stream": True}) as r:
        import json

        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    texts = [c["choices"][0]["text"] for c in chunks]
    assert texts[0] == PROMPT and "".join(texts) == complete(client, max_tokens=5, echo=True)["text"]


@pytest.mark.parametrize("body, param, code", [
    ({"logprobs": 1, "stream": True}, "logprobs", "unsupported_parameter"),
    ({"max_tokens": 0}, "max_tokens", "invalid_value"),
    ({"logprobs": 21}, "logprobs", None),
    ({"logprobs": True}, "logprobs", None),
    ({"prompt": [5, 10**6]}, "prompt", "invalid_value"),
    ({"prompt": [[1], [2]]}, "prompt", None),
])
def test_what_logprobs_and_echo_refuse(served, body, param, code):
    client, _, _ = served["model"]
    r = client.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and (code is None or err["code"] == code), err
    r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                  "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter"
