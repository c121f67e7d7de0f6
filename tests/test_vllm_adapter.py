"""A pretrained base + Engram adapter served by vLLM (vLLM's own Llama / Qwen3 / Mistral, engram's adapter layers
hooked in: `engram.integrations.vllm.adapter_model`; Qwen2 too): greedy tokens equal `engram sample --base --adapter
--temperature 0`'s.

Needs vLLM (marker `vllm`; `scripts/test_vllm.sh` runs it). Tiny random bases (hidden 64, head_dim 32, float32) with
an adapter at block 1 whose value rows, conv and table are randomized (a fresh adapter's delta is 0). One server
per base kind; the Llama one also serves the preemption, prefix-caching and CLI checks. A token may differ only
at a near tie of engram's own logits (`test_vllm.assert_same`).
"""

import importlib.util
import json
import os
import random
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (scripts/test_vllm.sh sets one up)")]

from pairs import base_and_adapter, save_adapter_for, save_base  # noqa: E402
from test_vllm import (  # noqa: E402
    LENGTHS,
    LONG,
    NEW,
    SETTINGS,
    SRC,
    Server,
    api_server,
    assert_same,
    free_port,
    greedy_with_gaps,
)

VOCAB = 400


def prompts_of(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def reference(base, adapter, prompts, overlays=(), new=NEW, adapter_on=True, table_format=None, lora=True):
    """`engram sample --base --adapter --temperature 0`'s greedy tokens (its generate call), each step's top-2 gap.
    `lora` False: an adapter's LoRA left off (`load_adapter(lora=False)`), its Engram part alone."""
    from engram.cli.options import with_overlays
    from engram.inference import load_with_adapter

    model, _ = load_with_adapter(base, adapter if adapter_on and lora else None)
    if adapter_on and not lora:
        from engram.adapters import load_adapter

        model = load_adapter(model, adapter, lora=False)
    if overlays or table_format:
        with_overlays(model, list(overlays), table_format)
    return greedy_with_gaps(model, prompts, new)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_pairs")
    return {k: base_and_adapter(root, k) for k in ("llama", "qwen3", "mistral", "qwen2")}


def pair_folder(base, adapter, out):
    from engram.integrations.vllm.pair import write_pair

    return write_pair(base, adapter, out)


@pytest.fixture(scope="module")
def llama(pairs, tmp_path_factory):
    base, adapter = pairs["llama"]
    d = pair_folder(base, adapter, tmp_path_factory.mktemp("pair") / "llama")
    s = api_server(d, tmp_path_factory.mktemp("logs") / "llama.log")
    yield base, adapter, s
    s.close()


# ------------------------------------------------------------------------------------------- Llama: every case
def test_llama_16_concurrent_prompts_chunked_prefill(llama):
    base, adapter, s = llama
    prompts = prompts_of(LENGTHS, 0)
    ref = reference(base, adapter, prompts)
    plain = reference(base, adapter, prompts, adapter_on=False)
    assert sum(a[0] != b[0] for a, b in zip(ref, plain)) >= 8, "the adapter barely changes the tokens: vacuous"
    assert_same(s.many(prompts), ref, "llama + adapter: 16 concurrent prompts")


def test_llama_preemption(llama):
    base, adapter, s = llama
    rng = random.Random(5)
    prompts = prompts_of([rng.randrange(60, 120) for _ in range(12)], 5)
    before = s.metric("vllm:num_preemptions_total")
    got = s.many(prompts, n=LONG)
    assert s.metric("vllm:num_preemptions_total") > before, "no preemption happened: the test did not exercise it"
    assert_same(got, reference(base, adapter, prompts, new=LONG), "llama + adapter: preemption")


def test_llama_shared_prefix_with_prefix_caching(llama):
    base, adapter, s = llama
    prefix = prompts_of((300,), 1)[0]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22, 23, 24]]
    hits = s.metric("vllm:prefix_cache_hits_total")
    got = [s.complete(p) for p in prompts]
    assert s.metric("vllm:prefix_cache_hits_total") >= hits + 256, "the second prompt did not hit the prefix cache"
    assert_same(got, reference(base, adapter, prompts), "llama + adapter: shared prefix")


def test_engram_sample_base_adapter_cli_equals_vllm(llama):
    base, adapter, s = llama
    from engram.tokenizer import load_tokenizer

    tok = load_tokenizer(base / "tokenizer.json")
    text = "The quick brown fox"
    ids = tok.encode(text, add_special_tokens=False).ids
    got = s.complete(ids, ignore_eos=False)
    r = subprocess.run([sys.executable, "-m", "engram.cli", "sample", "--base", str(base), "--adapter", str(adapter),
                        "--prompt", text, "--temperature", "0", "--max-new-tokens", str(NEW)], capture_output=True,
                       text=True, env=dict(os.environ, PYTHONPATH=SRC), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == tok.decode(ids + got), "engram sample --base --adapter and vLLM differ"


# ------------------------------------------------------------------------------------------- other bases
@pytest.mark.parametrize("kind", ["qwen3", "mistral", "qwen2"])
def test_other_bases_16_concurrent_prompts(pairs, kind, tmp_path):
    """Also: started without --enforce-eager, which the pair's config hook turns on (hooks, host-side hashing)."""
    base, adapter = pairs[kind]
    prompts = prompts_of(LENGTHS, 2)
    ref = reference(base, adapter, prompts)
    plain = reference(base, adapter, prompts, adapter_on=False)
    assert sum(a[0] != b[0] for a, b in zip(ref, plain)) >= 8, "the adapter barely changes the tokens: vacuous"
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
            str(pair_folder(base, adapter, tmp_path / "pair")), "--served-model-name", "m", "--dtype", "float32",
            "--port", str(free_port()), *SETTINGS]
    s = Server(argv, tmp_path / f"{kind}.log")
    try:
        assert "enforce_eager=True" in s.log.read_text()
        assert_same(s.many(prompts), ref, f"{kind} + adapter: 16 concurrent prompts")
    finally:
        s.close()


# ------------------------------------------------------------------------------------------- engram serve
def make_overlay(base, adapter, prompts, out):
    """An overlay changing (by a lot) every row of the adapter's layer 1 that the prompts read."""
    import torch

    from engram.adapters import adapter_of
    from engram.editing import Overlay, model_digest
    from engram.inference import load_with_adapter

    model, _ = load_with_adapter(base, adapter)
    mapping = adapter_of(model).mapping
    rows = torch.cat([torch.as_tensor(mapping.hash(torch.tensor([p]), offsets=True)[1]).reshape(-1) for p in prompts])
    rows = rows.long().unique()
    g = torch.Generator().manual_seed(1)
    values = 5 * torch.randn(rows.numel(), adapter_of(model).config.head_dim, generator=g)
    meta = {"hash_spec_sha256": mapping.spec_digest(), "base_digest": model_digest(model), "layers": [1]}
    return Overlay({1: rows}, {1: values}, meta).save(out)


def test_engram_serve_base_adapter_disk_tier_int8_and_overlay(pairs, tmp_path):
    base, adapter = pairs["llama"]
    prompts = prompts_of((3, 30, 90, 150), 3)
    ov = make_overlay(base, adapter, prompts, tmp_path / "overlay")
    ref = reference(base, adapter, prompts, [ov], table_format="int8")
    plain = reference(base, adapter, prompts, table_format="int8")
    assert any(a[0] != b[0] for a, b in zip(ref, plain)), "the overlay changes nothing: the check would be vacuous"
    argv = [sys.executable, "-m", "engram.cli", "serve", "--base", str(base), "--adapter", str(adapter), "--engine",
            "vllm", "--served-model-name", "m", "--port", str(free_port()), "--table-tier", "disk", "--table-dir",
            str(tmp_path / "t"), "--table-format", "int8", "--overlay", str(ov), "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "serve.log", env={"ENGRAM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        assert_same(s.many(prompts), ref, "engram serve --base --adapter --engine vllm, disk tier, int8, overlay")
        assert any((tmp_path / "t").iterdir())  # the disk tier's files
    finally:
        s.close()


def test_tensor_parallel_2_same_tokens(pairs, tmp_path):
    from engram.integrations.vllm.launcher import cpu_bind

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallel 2 needs 2 CPU cores")
    base, adapter = pairs["llama"]
    prompts = prompts_of((4, 50, 130), 4)
    s = api_server(pair_folder(base, adapter, tmp_path / "pair"), tmp_path / "tp2.log", "--tensor-parallel-size",
                   "2", env={"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(2)})
    try:
        assert_same(s.many(prompts), reference(base, adapter, prompts), "llama + adapter, tensor parallel 2")
    finally:
        s.close()


def test_wrong_base_refused_with_engrams_message(pairs, tmp_path):
    """A pair folder whose base was replaced after it was written: vLLM's API server refuses it before any worker
    starts, in engram's words; `engram serve --engine vllm` refuses the wrong base before starting vLLM."""
    base, adapter = pairs["llama"]
    other = save_base(tmp_path / "other", "llama", seed=7)
    d = pair_folder(base, adapter, tmp_path / "pair")
    cfg = json.loads((d / "config.json").read_text())
    cfg["engram_pair"]["base"] = str(other)
    (d / "config.json").write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(d), "--dtype",
                        "float32", "--port", str(free_port())], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode != 0
    msg = "was saved for another base model: its embedding weights differ"
    assert msg in r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "engram.cli", "serve", "--base", str(other), "--adapter", str(adapter),
                        "--engine", "vllm"], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=SRC, ENGRAM_CACHE_DIR=str(tmp_path / "cache")))
    assert r.returncode != 0 and msg in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ------------------------------------------------------------------------------------------- LoRA + Engram
LOGPROB_TOL = 1e-4  # |vLLM's logprob - engram's| of each greedy token (float32 both; 4e-6 to 9e-6 measured here)


def lora_engram_adapter(base, out):
    """A LoRA + Engram adapter on `base` (`engram adapt --method lora+engram`'s files) whose LoRA changes the model:
    PEFT starts lora_B at 0 (a delta of exactly 0), so it is randomized here and the adapter saved again."""
    import torch

    from engram.adapters import save_adapter
    from engram.inference import load_with_adapter

    save_adapter_for(base, out, lora=True)
    model, _ = load_with_adapter(base, out)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    save_adapter(model, out)
    return out


def greedy_logprobs(base, adapter, prompt, tokens):
    """engram's log-probability (log_softmax of the LoRA + Engram model's float32 logits) of each of `tokens` after
    `prompt`, one forward over both."""
    import torch

    from engram.inference import load_with_adapter

    model, _ = load_with_adapter(base, adapter)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def test_lora_and_engram_adapter_served_by_engram_serve(pairs, tmp_path):
    """`engram serve --engine vllm` of an adapter holding LoRA beside Engram: the served name is the adapter as
    trained (vLLM's LoRA on the pair's Engram), equal to engram's own LoRA + Engram model (greedy tokens; logprobs
    within LOGPROB_TOL); `NAME-no-lora` is the Engram part alone, equal to the adapter loaded without its LoRA."""
    pytest.importorskip("peft")
    base, _ = pairs["llama"]
    adapter = lora_engram_adapter(base, tmp_path / "lora-engram")
    prompts = prompts_of(LENGTHS, 6)
    ref = reference(base, adapter, prompts)
    alone = reference(base, adapter, prompts, lora=False)
    assert sum(a[0] != b[0] for a, b in zip(ref, alone)) >= 8, "the LoRA barely changes the tokens: vacuous"
    argv = [sys.executable, "-m", "engram.cli", "serve", "--base", str(base), "--adapter", str(adapter), "--engine",
            "vllm", "--served-model-name", "m", "--port", str(free_port()), "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "serve.log", env={"ENGRAM_CACHE_DIR": str(tmp_path / "cache")})
    try:
        log = s.log.read_text()
        assert "--enable-lora" in log and "--max-lora-rank 8" in log, s.tail()
        models = json.load(urllib.request.urlopen(s.url + "/v1/models", timeout=30))["data"]
        assert {m["id"] for m in models} == {"m", "m-no-lora"}, models
        assert_same(s.many(prompts), ref, "engram serve --engine vllm, LoRA + Engram adapter, as m")
        with ThreadPoolExecutor(len(prompts)) as ex:
            got = list(ex.map(lambda p: s.complete(p, model="m-no-lora"), prompts))
        assert_same(got, alone, "engram serve --engine vllm, LoRA + Engram adapter, as m-no-lora (Engram alone)")
        for p in prompts[3:6]:
            c = s.choice(p, logprobs=0)
            want = greedy_logprobs(base, adapter, p, c["token_ids"])
            diff = max(abs(a - b) for a, b in zip(c["logprobs"]["token_logprobs"], want))
            assert diff < LOGPROB_TOL, f"vLLM's logprobs differ from engram's by {diff:.2e}"
    finally:
        s.close()


def test_lora_pair_without_enable_lora_refused(pairs, tmp_path):
    """The pair folder of a LoRA + Engram adapter served by vLLM by hand without --enable-lora: refused before any
    worker starts (every request would run without the LoRA), naming the flags."""
    pytest.importorskip("peft")
    base, _ = pairs["llama"]
    adapter = save_adapter_for(base, tmp_path / "lora-engram", lora=True)
    d = pair_folder(base, adapter, tmp_path / "pair")
    r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(d), "--dtype",
                        "float32", "--port", str(free_port())], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode != 0
    assert "holds LoRA beside Engram, and vLLM runs without LoRA: start it with --enable-lora" in r.stdout + r.stderr
