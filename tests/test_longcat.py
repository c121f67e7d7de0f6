"""LongCat-Flash-Lite's n-gram embedding against the engines it is served by:

- plain-Python oracles written here from the engines' code as read (vLLM 0.32's `LongcatNgramModelState`, whose
  per-request context keeps the last n-1 ids with EOS negated, and its kernel; SGLang 0.5.23's per-request token
  table and kernels), one n-gram at a time, with prompts that start mid-sequence and EOS inside the window;
- SGLang's own kernels, compiled for the CPU from its source where a sglang wheel or install is at hand
  (ENGRAM_SGLANG_SRC=path/to/sglang-*.whl, or an installed sglang), else skipped;
- vLLM's own Python (`NgramEmbedding`, `LongcatNgramModelState`) imported and run on CPU torch, its CUDA-only
  id kernel replaced by the oracle's kernel loop (marked `vllm`: needs vllm importable);
- a synthetic checkpoint in the released key layout (two shards) served from RAM, mmap and the disk tier.
"""

import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import warnings
import zipfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import damaged_copy, drop_from_index, truncate_file

from engram.config import ConfigError
from engram.hashing import NgramHashMapping, family_class
from engram.integrations import longcat as lc
from engram.tables.base import TableError


def config(**kw):
    c = dict(vocab_size=50, ngram_vocab_size_ratio=3, emb_split_num=2, emb_neighbor_num=3, eos_token_id=2,
             hidden_size=16, model_type="longcat_flash_ngram")
    c.update(kw)
    return c


def random_config(g):
    return config(vocab_size=int(g.integers(20, 400)), ngram_vocab_size_ratio=float(g.choice([1, 2.5, 7, 0.75])),
                  emb_split_num=int(g.integers(1, 5)), emb_neighbor_num=int(g.integers(2, 6)),
                  eos_token_id=int(g.integers(0, 20)))


def sequence(g, V, eos, T):
    """Random ids with EOS at the start, twice in a row, inside and at the end."""
    ids = g.integers(0, V, size=T)
    ids[g.random(T) < 0.15] = eos
    ids[0] = eos
    ids[T // 2: T // 2 + 2] = eos
    ids[-1] = eos
    return [int(v) for v in ids]


# ------------------------------------------------------------------------------------------ oracles
def layout(cfg, engine):
    """(sizes, offsets, weights[e][d]) as each engine builds them (vLLM: int(m + 2e + 1) with m = ratio * V as
    computed; SGLang: int(ratio * V) + 2e + 1)."""
    V, k, n = cfg["vocab_size"], cfg["emb_split_num"], cfg["emb_neighbor_num"]
    m = cfg["ngram_vocab_size_ratio"] * V
    E = k * (n - 1)
    sizes = [int(m + 2 * e + 1) if engine == "vllm" else int(m) + 2 * e + 1 for e in range(E)]
    offsets = [sum(sizes[:e]) for e in range(E)]
    return sizes, offsets, [[pow(V, d, M) for d in range(n)] for M in sizes]


def walk(table, col, n, k, weights, mods, sums, eos=None):
    """One position's ids, as the engines' id kernels compute them from a token table row (list): for embedder
    e = i*k + j, back from `col` over i+2 tokens, stopping before the row's start, at a negative entry, and
    (SGLang) at `eos` when looking back; sum of (token * weights[i][j][d]) mod M, mod M, plus the offset."""
    out = []
    for i in range(n - 1):
        for j in range(k):
            M, h = int(mods[i][j]), 0
            for d in range(i + 2):
                if col - d < 0 or table[col - d] < 0 or (eos is not None and d > 0 and table[col - d] == eos):
                    break
                h += (int(table[col - d]) * int(weights[i][j][d])) % M
            out.append(h % M + int(sums[i * k + j]))
    return out


def kernel_ids(cfg, table, col, engine, eos=None):
    """`walk` with the constants of `engine`'s layout."""
    sizes, offsets, w = layout(cfg, engine)
    k, n = cfg["emb_split_num"], cfg["emb_neighbor_num"]
    return walk(table, col, n, k, [w[i * k:(i + 1) * k] for i in range(n - 1)],
                [sizes[i * k:(i + 1) * k] for i in range(n - 1)], offsets, eos)


class VllmState:
    """vLLM's LongcatNgramModelState, one request: a context of the last n-1 processed ids, EOS negated, -1 before
    the request; each step hashes [context | chunk] and keeps its last n-1 entries."""

    def __init__(self, cfg, computed=()):
        self.cfg, n1, eos = cfg, cfg["emb_neighbor_num"] - 1, cfg["eos_token_id"]
        tail = [-t if t == eos else t for t in list(computed)[max(0, len(computed) - n1):]]
        self.ctx = [-1] * (n1 - len(tail)) + tail

    def step(self, chunk):
        eos, n1 = self.cfg["eos_token_id"], len(self.ctx)
        table = self.ctx + [-t if t == eos else t for t in chunk]
        rows = [kernel_ids(self.cfg, table, n1 + p, "vllm") for p in range(len(chunk))]
        self.ctx = table[len(table) - n1:]
        return rows


def sglang_ids(cfg, ids, start):
    """SGLang: the request's token table holds raw ids at their positions; rows of positions start.. ."""
    return [kernel_ids(cfg, ids, p, "sglang", eos=cfg["eos_token_id"]) for p in range(start, len(ids))]


def chunks_of(g, T):
    cuts = sorted(set(g.integers(1, T, size=3).tolist()))
    bounds = [0] + cuts + [T]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


# ------------------------------------------------------------------------------------------ hashing
@pytest.mark.parametrize("seed", range(4))
def test_ids_match_vllms_state_and_kernel_chunked_mid_sequence_and_decoding(seed):
    g = np.random.default_rng(seed)
    cfg = random_config(g)
    m = lc.hash_mapping(cfg)
    n1 = cfg["emb_neighbor_num"] - 1
    for computed in (0, 1, 6):  # a fresh request, and requests resumed after `computed` ids (mid-sequence)
        ids = sequence(g, cfg["vocab_size"], cfg["eos_token_id"], 24)
        state = VllmState(cfg, ids[:computed])
        for a, b in chunks_of(g, 24 - computed) + [(24 - computed, 24 - computed)]:
            a, b = a + computed, b + computed
            if a == b:
                continue
            want = state.step(ids[a:b])
            hist = torch.tensor([ids[max(0, a - n1):a]])
            got = m.hash_continuation(torch.tensor([ids[a:b]]), hist, offsets=True)[0]
            assert got.dtype == torch.int32 and got[0].tolist() == want, (cfg, computed, a, b)
        # decoding: one id at a time after the prompt
        state = VllmState(cfg, ids[:12])
        for t in range(12, 24):
            got = m.hash_continuation(torch.tensor([ids[t:t + 1]]), torch.tensor([ids[t - n1:t]]), offsets=True)[0]
            assert got[0].tolist() == state.step([ids[t]])
    # one pass over a batch equals the fresh request's steps
    batch = [sequence(g, cfg["vocab_size"], cfg["eos_token_id"], 15) for _ in range(3)]
    got = m.hash(np.array(batch), offsets=True)[0]
    assert got.dtype == np.int32
    assert [r.tolist() for r in got] == [VllmState(cfg).step(b) for b in batch]


@pytest.mark.parametrize("seed", range(3))
def test_ids_match_sglangs_token_table_with_eos_rule_sglang(seed):
    g = np.random.default_rng(100 + seed)
    cfg = random_config(g)
    m = lc.hash_mapping(cfg, eos_rule="sglang")
    n1 = cfg["emb_neighbor_num"] - 1
    ids = sequence(g, cfg["vocab_size"], cfg["eos_token_id"], 30)
    for start in (0, 1, 9, 29):  # a prefix-cache hit of `start` ids: the table holds the n-1 before it
        got = m.hash_continuation(torch.tensor([ids[start:]]), torch.tensor([ids[max(0, start - n1):start]]),
                                  offsets=True)[0]
        assert got[0].tolist() == sglang_ids(cfg, ids, start)


def test_the_engines_disagree_only_at_an_eos_position():
    cfg = config(emb_split_num=3, emb_neighbor_num=4)
    ids = torch.tensor([[7, 2, 9, 11, 2, 2, 4, 13, 14, 2]])
    v, s = lc.hash_mapping(cfg).hash(ids, offsets=True)[0], lc.hash_mapping(cfg, "sglang").hash(ids, offsets=True)[0]
    eos = ids[0] == 2
    offsets = torch.tensor(lc.read_config(cfg).offsets, dtype=torch.int32)
    assert torch.equal(v[0, ~eos], s[0, ~eos])
    assert (v[0, eos] == offsets).all()  # vLLM: an EOS is an empty n-gram, row 0 of every embedder
    assert not (s[0, eos] == offsets).all(dim=1).any()  # SGLang: it hashes with the ids before it
    # an EOS id of 0: -0 is not negative, so vLLM's walk never stops at it (SGLang's does, looking back)
    c0 = config(eos_token_id=0)
    z = torch.tensor([[5, 0, 6, 7]])
    assert lc.hash_mapping(c0).hash(z, offsets=True)[0][0].tolist() == VllmState(c0).step(z[0].tolist())
    assert lc.hash_mapping(c0, "sglang").hash(z, offsets=True)[0][0].tolist() == sglang_ids(c0, z[0].tolist(), 0)


@pytest.mark.parametrize("V, ratio, k, n", [(131072, 78, 4, 4), (163840, 100.567, 4, 5)])
def test_ids_at_full_scale_constants(V, ratio, k, n):
    """Vocabularies and table sizes of the released scale (tables of 10-16.5M rows, 122-263M rows in all): the
    64-bit sums stay exact, ids near the top of the vocabulary included."""
    cfg = config(vocab_size=V, ngram_vocab_size_ratio=ratio, emb_split_num=k, emb_neighbor_num=n, eos_token_id=2)
    g = np.random.default_rng(7)
    ids = sequence(g, V, 2, 40)
    ids[5:9] = [V - 1, V - 2, V - 1, V - 3]
    assert lc.hash_mapping(cfg).hash(torch.tensor([ids]), offsets=True)[0][0].tolist() == VllmState(cfg).step(ids)
    got = lc.hash_mapping(cfg, "sglang").hash(torch.tensor([ids]), offsets=True)[0][0].tolist()
    assert got == sglang_ids(cfg, ids, 0)


def test_layout_float_ratio_spec_round_trip_and_family_registry(tmp_path):
    cfg = config(vocab_size=41, ngram_vocab_size_ratio=2.5, emb_split_num=2, emb_neighbor_num=4)
    m = lc.hash_mapping(cfg)
    sizes, offsets, _ = layout(cfg, "vllm")
    assert sizes == layout(cfg, "sglang")[0] == [103, 105, 107, 109, 111, 113]
    assert m.head_sizes(0) == sizes and m.head_offsets(0) == offsets and m.layer_ids == [0]
    # column e = i*k + j: order i+2, split j
    assert m.vocab_size_across_layers[0] == [[103, 105], [107, 109], [111, 113]]
    m.save_spec(tmp_path / "spec.json")
    again = NgramHashMapping.from_spec(tmp_path / "spec.json")
    ids = torch.tensor([[1, 2, 3, 40, 2, 5, 6]])
    assert again.family.name == "longcat" and torch.equal(again.hash(ids)[0], m.hash(ids)[0])
    assert family_class("longcat") is lc.LongCatFamily
    with pytest.raises(ConfigError, match="hashing mismatch on 'layers'"):  # the EOS rule is part of the identity
        lc.hash_mapping(cfg, "sglang").check_spec(m.spec())


def test_bad_configs_and_inputs_are_one_line():
    cases = [({"model_type": "llama", "vocab_size": 10}, "not a LongCat n-gram embedding config"),
             (config(emb_neighbor_num=1), "emb_neighbor_num must be an integer >= 2"),
             (config(eos_token_id=None), "eos_token_id must be a token id"),
             (config(eos_token_id=[2, 3]), "eos_token_id lists 2 ids"),
             (config(ngram_vocab_size_ratio=-1), "positive number"),
             (config(vocab_size=10 ** 6, ngram_vocab_size_ratio=3000), "int32")]
    for cfg, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            lc.hash_mapping(cfg)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="eos_rule"):
        lc.hash_mapping(config(), eos_rule="hf")
    with pytest.raises(ConfigError, match="torch path"):
        lc.hash_mapping(config(), kernel="numba")
    assert lc.hash_mapping(config(eos_token_id=[2], oe_split_num=9)).family.cfg.eos_token_id == 2
    from engram.hashing import HashInputError

    with pytest.raises(HashInputError, match="outside"):
        lc.hash_mapping(config()).hash(torch.tensor([[1, 50]]))


# ------------------------------------------------------------------------------------------ SGLang's kernels
SGLANG_CUH = "sglang/kernels/jit/csrc/speculative/ngram_embedding.cuh"
SHIM = r"""
#include <algorithm>
#include <cstdint>
#define __global__
#define __restrict__
struct engram_dim3 { int x = 0; };
static engram_dim3 blockIdx, threadIdx, blockDim, gridDim;
namespace sglang {
%s
}
using namespace sglang::device::ngram_embedding;
// a CUDA launch, run one block and one thread after another (the kernels use no shared memory or barriers)
#define LAUNCH(G, B, CALL) do { gridDim.x = (G); blockDim.x = (B); for (int b_ = 0; b_ < (G); ++b_) \
  for (int t_ = 0; t_ < (B); ++t_) { blockIdx.x = b_; threadIdx.x = t_; CALL; } } while (0)
extern "C" {
void compute(int bs, int n, int k, int* w, int* mods, int* sums, int* tokens, int* req_sums, int* table, int ctx,
             const int64_t* rows, int* cols, int* out, int eos) {
  LAUNCH((n - 1) * k * bs, 256, ComputeNGramIdsKernel(bs, n, k, w, mods, sums, tokens, req_sums, table, ctx, rows,
                                                      cols, out, eos));
}
void compute_decode(int bs, int n, int k, const int* w, const int* mods, const int* sums, const int* table, int ctx,
                    const int64_t* rows, const int* cols, int* out, int eos) {
  int total = bs * (n - 1) * k;
  int grid = std::min(kMaxComputeNGramIdsDecodeBlocks, (total + kDecodeBlockSize - 1) / kDecodeBlockSize);
  LAUNCH(grid, kDecodeBlockSize, ComputeNGramIdsDecodeKernel(bs, n, k, w, mods, sums, table, ctx, rows, cols, out,
                                                             eos));
}
void update(int bs, int* tokens, int* table, int ctx, const int64_t* rows, int* cols, int* lens, int n_ignore,
            int* ignore) {
  LAUNCH(bs, 256, UpdateTokenTableKernel(bs, tokens, table, ctx, rows, cols, lens, n_ignore, ignore));
}
}
"""


def _sglang_source():
    where = os.environ.get("ENGRAM_SGLANG_SRC")
    if where:
        p = Path(where)
        return zipfile.ZipFile(p).read(SGLANG_CUH).decode() if zipfile.is_zipfile(p) else (p / SGLANG_CUH).read_text()
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.origin:
        f = Path(spec.origin).parent.parent / SGLANG_CUH
        if f.is_file():
            return f.read_text()
    return None


@pytest.fixture(scope="module")
def sglang_kernels(tmp_path_factory):
    src = _sglang_source()
    if src is None:
        pytest.skip("SGLang's n-gram kernel source not found: set ENGRAM_SGLANG_SRC to a sglang wheel "
                    "(pip download --no-deps sglang==0.5.23) or install sglang")
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler to build SGLang's kernels for the CPU")
    body = re.search(r"namespace device::ngram_embedding \{.*?\}  // namespace device::ngram_embedding", src, re.S)
    assert body, f"{SGLANG_CUH}: the kernels' namespace was not found (has the file changed?)"
    d = tmp_path_factory.mktemp("sgl")
    (d / "k.cpp").write_text(SHIM % body.group(0))
    subprocess.run([cxx, "-O1", "-std=c++17", "-shared", "-fPIC", str(d / "k.cpp"), "-o", str(d / "k.so")],
                   check=True, capture_output=True)
    return ctypes.CDLL(str(d / "k.so"))


def _p(a):
    return a.ctypes.data_as(ctypes.c_void_p)


def _consts(cfg, engine):
    sizes, offsets, w = layout(cfg, engine)
    n, k = cfg["emb_neighbor_num"], cfg["emb_split_num"]
    return (np.array(w, dtype=np.int32).reshape(n - 1, k, n), np.array(sizes, dtype=np.int32).reshape(n - 1, k),
            np.array(offsets + [offsets[-1] + sizes[-1]], dtype=np.int32))


@pytest.mark.parametrize("seed", range(3))
def test_sglangs_kernels_compiled_for_the_cpu(sglang_kernels, seed):
    """SGLang's flow: extend writes the prompt (from n-1 before a cached prefix) into the request's table row, then
    the extend kernel hashes it; each decode step writes the sampled id at its position and runs the decode kernel.
    Equal to engram's `eos_rule="sglang"`; and the same kernel with its EOS argument off, on vLLM's table (EOS
    negated, -1 before the request), equals engram's default rule."""
    K = sglang_kernels
    g = np.random.default_rng(200 + seed)
    cfg = random_config(g)
    n, k, eos = cfg["emb_neighbor_num"], cfg["emb_split_num"], cfg["eos_token_id"]
    E, CTX = k * (n - 1), 64
    w, mods, sums = _consts(cfg, "sglang")
    reqs = [sequence(g, cfg["vocab_size"], eos, 30) for _ in range(3)]
    starts, prompt_end = [0, 3, 11], 20  # prefix-cache hits of 0, 3 and 11 ids
    table = np.full((4, CTX), -7, dtype=np.int32)  # (slots of the request pool; -7 never read)
    rows = np.array([2, 0, 3], dtype=np.int64)  # request -> table row
    toks, cols, lens = [], [], []
    for ids, s in zip(reqs, starts):
        lo = 0 if s < n else s - n + 1  # the manager's rule
        toks += ids[lo:prompt_end]
        cols.append(lo)
        lens.append(prompt_end - lo)
    toks, cols, lens = (np.array(x, dtype=np.int32) for x in (toks, cols, lens))
    K.update(3, _p(toks), _p(table), CTX, _p(rows), _p(cols), _p(lens), 0, None)
    ext = [ids[s:prompt_end] for ids, s in zip(reqs, starts)]
    tokens = np.array([t for e in ext for t in e], dtype=np.int32)
    req_sums = np.concatenate([[0], np.cumsum([len(e) for e in ext])]).astype(np.int32)
    out = np.zeros((len(tokens), E), dtype=np.int32)
    K.compute(3, n, k, _p(w), _p(mods), _p(sums), _p(tokens), _p(req_sums), _p(table), CTX, _p(rows),
              _p(np.array(starts, dtype=np.int32)), _p(out), eos)
    m = lc.hash_mapping(cfg, eos_rule="sglang")
    at = 0
    for ids, s in zip(reqs, starts):
        got = m.hash_continuation(torch.tensor([ids[s:prompt_end]]), torch.tensor([ids[max(0, s - n + 1):s]]),
                                  offsets=True)[0][0]
        assert got.tolist() == out[at:at + len(got)].tolist()
        assert got.tolist() == sglang_ids(cfg, ids[:prompt_end], s)  # (the oracle agrees with the kernel)
        at += len(got)
    for t in range(prompt_end, 30):  # decoding
        new = np.array([ids[t] for ids in reqs], dtype=np.int32)
        K.update(3, _p(new), _p(table), CTX, _p(rows), _p(np.full(3, t, dtype=np.int32)),
                 _p(np.ones(3, dtype=np.int32)), 0, None)
        dec = np.zeros((3, E), dtype=np.int32)
        K.compute_decode(3, n, k, _p(w), _p(mods), _p(sums), _p(table), CTX, _p(rows),
                         _p(np.full(3, t, dtype=np.int32)), _p(dec), eos)
        got = m.hash_continuation(torch.tensor([[ids[t]] for ids in reqs]),
                                  torch.tensor([ids[t - n + 1:t] for ids in reqs]), offsets=True)[0][:, 0]
        assert got.tolist() == dec.tolist()
    # vLLM's kernel is this one without the EOS argument: run it on vLLM's table with that check off
    w, mods, sums = _consts(cfg, "vllm")
    ids = reqs[0]
    vt = np.array([[-1] * (n - 1) + [-t if t == eos else t for t in ids]], dtype=np.int32)
    out = np.zeros((len(ids), E), dtype=np.int32)
    K.compute(1, n, k, _p(w), _p(mods), _p(sums), _p(np.zeros(len(ids), dtype=np.int32)),
              _p(np.array([0, len(ids)], dtype=np.int32)), _p(vt), vt.shape[1], _p(np.zeros(1, dtype=np.int64)),
              _p(np.array([n - 1], dtype=np.int32)), _p(out), -(1 << 30))
    assert lc.hash_mapping(cfg).hash(torch.tensor([ids]), offsets=True)[0][0].tolist() == out.tolist()
    assert out.tolist() == VllmState(cfg).step(ids)


# ------------------------------------------------------------------------------------------ checkpoint
def write_checkpoint(d, cfg, dtype=torch.bfloat16, seed=0):
    """config.json and two shards in the released key layout: the word embedding and half the embedders in one,
    the rest and the projections in the other."""
    from safetensors.torch import save_file

    d.mkdir(parents=True)
    c = lc.read_config(cfg)
    g = torch.Generator().manual_seed(seed)
    t = {lc.WORD_KEY: torch.randn(c.vocab_size, c.hidden_size, generator=g).to(dtype)}
    for e, M in enumerate(c.sizes):
        t[f"{lc.PREFIX}embedders.{e}.weight"] = torch.randn(M, c.emb_dim, generator=g).to(dtype)
        t[f"{lc.PREFIX}post_projs.{e}.weight"] = (torch.randn(c.hidden_size, c.emb_dim, generator=g) / 3).to(dtype)
    keys = sorted(t)
    half = {k for k in keys if "embedders" in k and int(k.split(".")[3]) < c.num_embedders // 2} | {lc.WORD_KEY}
    files = {"model-00001-of-00002.safetensors": {k: t[k] for k in keys if k in half},
             "model-00002-of-00002.safetensors": {k: t[k] for k in keys if k not in half}}
    for name, part in files.items():
        save_file(part, str(d / name))
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: name for name, part in files.items() for k in part}}))
    (d / "config.json").write_text(json.dumps(cfg))
    return d, t


def oracle_embedding(c, t, ids, hash_ids):
    """float64, one position at a time: the mean of the word row and each embedder's row times its projection."""
    out = torch.zeros(*ids.shape, c.hidden_size, dtype=torch.float64)
    for b in range(ids.shape[0]):
        for p in range(ids.shape[1]):
            acc = t[lc.WORD_KEY][ids[b, p]].double()
            for e in range(c.num_embedders):
                row = t[f"{lc.PREFIX}embedders.{e}.weight"][int(hash_ids[b, p, e]) - c.offsets[e]].double()
                acc = acc + t[f"{lc.PREFIX}post_projs.{e}.weight"].double() @ row
            out[b, p] = acc / (c.num_embedders + 1)
    return out


TIERS = [("ram", {}), ("mmap", {}), ("disk", {}), ("mmap", {"dir": "m"}), ("disk", {"dir": "k"})]


def test_checkpoint_rows_and_embedding_from_every_tier(tmp_path):
    cfg = config(emb_split_num=2, emb_neighbor_num=4, hidden_size=24)
    d, t = write_checkpoint(tmp_path / "ckpt", cfg)
    c = lc.read_config(cfg)
    ids = torch.tensor([[5, 7, 2, 9, 11, 2, 2, 4, 13], [0, 49, 48, 2, 1, 3, 3, 3, 3]])
    hist = torch.tensor([[3, 4, 2], [6, 2, 8]])
    assert [t[f"{lc.PREFIX}embedders.{e}.weight"].shape[0] for e in range(c.num_embedders)] == c.sizes
    concat = torch.cat([t[f"{lc.PREFIX}embedders.{e}.weight"] for e in range(c.num_embedders)])
    outs = []
    for backend, kw in TIERS:
        kw = {k: tmp_path / v for k, v in kw.items()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mem = lc.load(d, backend, **kw)
        if backend == "disk" and not kw:
            assert sum("no block checksums" in str(w.message) for w in caught) == 1
        if kw:
            assert (kw["dir"] / "longcat_ngram.safetensors.blocks").is_file()
        assert mem.table.num_rows == sum(c.sizes) and mem.table_bytes() == sum(c.sizes) * c.emb_dim * 2
        every = torch.randperm(sum(c.sizes))
        assert torch.equal(mem.table.gather(every), concat[every])  # the concatenated layout, row for row
        h = mem.mapping.hash_continuation(ids, hist, offsets=True)[0]
        outs.append(mem.embedding(ids, history=hist))
        assert torch.equal(outs[-1], mem.embedding(ids, h))
        mem.close()
    assert outs[0].dtype == torch.bfloat16 and all(torch.equal(o, outs[0]) for o in outs)
    # float32 (the config's torch_dtype): within 1e-5 of the float64 oracle
    (d / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}))
    mem = lc.load(d, "ram")
    assert mem.embedding.dtype == torch.float32
    h = mem.mapping.hash_continuation(ids, hist, offsets=True)[0]
    want = oracle_embedding(c, t, ids, h)
    assert (mem.embedding(ids, h).double() - want).abs().max() < 1e-5
    assert (outs[0].double() - want).abs().max() < 0.05  # bf16 end to end


def test_checkpoint_errors_are_one_line_and_load_nothing(tmp_path):
    cfg = config()
    d, _ = write_checkpoint(tmp_path / "ok", cfg)

    def broken(name, edit):
        return damaged_copy(d, tmp_path / name, edit)

    def drop_key(b):
        drop_from_index(b, f"{lc.PREFIX}embedders.3.weight")

    def other_ratio(b):
        (b / "config.json").write_text(json.dumps(config(ngram_vocab_size_ratio=4)))

    def not_longcat(b):
        (b / "config.json").write_text(json.dumps({"model_type": "qwen3", "vocab_size": 50}))

    def truncate(b):
        truncate_file(b / "model-00002-of-00002.safetensors", 3000)

    def int_rows(b):
        from safetensors.torch import load_file, save_file

        f = b / "model-00001-of-00002.safetensors"
        t = load_file(str(f))
        t[f"{lc.PREFIX}embedders.0.weight"] = t[f"{lc.PREFIX}embedders.0.weight"].to(torch.int16)
        save_file(t, str(f))

    cases = [(drop_key, ConfigError, "has no model.ngram_embeddings.embedders.3.weight"),
             (other_ratio, ConfigError, "the config needs"),
             (not_longcat, ConfigError, "not a LongCat n-gram embedding config"),
             (truncate, TableError, "truncated"),
             (int_rows, ConfigError, "I16")]
    for edit, err, msg in cases:
        b = broken(edit.__name__, edit)
        for backend in ("ram", "disk"):
            with pytest.raises(err, match=msg) as e:
                lc.load(b, backend, dir=tmp_path / f"copy-{edit.__name__}" if backend == "disk" else None)
            assert "\n" not in str(e.value)
            assert not (tmp_path / f"copy-{edit.__name__}").exists()  # nothing written before the checks passed
    with pytest.raises(ConfigError, match="tier must be"):
        lc.load(d, "gpu")
    mem = lc.load(d, "ram")
    with pytest.raises(ConfigError, match=r"must lie in \[0, "):
        mem.embedding(torch.tensor([[1]]), torch.full((1, 1, 4), 10 ** 6))


def test_a_flipped_byte_in_the_checked_copy_is_one_error_on_its_first_read(tmp_path):
    d, _ = write_checkpoint(tmp_path / "ckpt", config())
    lc.load(d, "disk", dir=tmp_path / "copy").close()
    f = tmp_path / "copy" / "longcat_ngram.safetensors"
    b = bytearray(f.read_bytes())
    b[len(b) // 2] ^= 0xFF
    f.write_bytes(bytes(b))
    from engram.tables.disk import DiskTable

    table = DiskTable(f)
    with pytest.raises(TableError, match="checksum|corrupt"):
        table.gather(torch.arange(table.num_rows))
    table.close()


# ------------------------------------------------------------------------------------------ vLLM's own Python
def vllm_kernel_cpu(cfg):
    """`ops.ngram_compute_n_gram_ids` on the CPU (vLLM's kernel is CUDA only): `walk` over each request's row
    of the table it is given, with the constants it is given (vLLM's own)."""

    def op(ne_n, ne_k, ne_weights, ne_mods, sums, qsl, table, row_indices, column_starts, n_gram_ids):
        W, M, S = ne_weights.tolist(), ne_mods.tolist(), sums.tolist()
        assert W == _consts(cfg, "vllm")[0].tolist() and M == _consts(cfg, "vllm")[1].tolist()
        for r in range(len(qsl) - 1):
            row = table[int(row_indices[r])].tolist()
            for p in range(int(qsl[r]), int(qsl[r + 1])):
                col = int(column_starts[r]) + p - int(qsl[r])
                n_gram_ids[p] = torch.tensor(walk(row, col, ne_n, ne_k, W, M, S))

    return op


@pytest.mark.vllm
def test_vllms_own_python_gives_the_same_ids_and_embeddings(monkeypatch):
    """vLLM's `NgramEmbedding` (constants, weight loading, `embed_batched`) and `LongcatNgramModelState`
    (`add_request`, `_compute_oe_ids`: per-request context, EOS negation, context roll) run as they are on CPU
    torch; only the CUDA id kernel is the loop above and the TP embedding a plain one."""
    vm = pytest.importorskip("vllm.model_executor.models.longcat_flash_ngram",
                             reason="vLLM is not importable here (scripts/test_vllm.sh builds an environment)")
    cfg = config(emb_split_num=3, emb_neighbor_num=4, hidden_size=36, vocab_size=60, ngram_vocab_size_ratio=2.5)

    class Vocab(torch.nn.Embedding):  # VocabParallelEmbedding on one rank
        def __init__(self, num, dim, params_dtype=None, **kw):
            super().__init__(num, dim, dtype=params_dtype)
            self.shard_indices = SimpleNamespace(org_vocab_start_index=0, org_vocab_end_index=num)

    monkeypatch.setattr(vm, "VocabParallelEmbedding", Vocab)
    monkeypatch.setattr(vm, "ops", SimpleNamespace(ngram_compute_n_gram_ids=vllm_kernel_cpu(cfg)))
    monkeypatch.setattr(vm.DefaultModelState, "add_request", lambda self, i, d: None)  # (rope positions only)
    hf = SimpleNamespace(**cfg, pad_token_id=0, torch_dtype=torch.float32)
    word = torch.nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
    ng = vm.NgramEmbedding(hf, word)
    c = lc.read_config(cfg)
    g = torch.Generator().manual_seed(0)
    t = {}
    for e in range(c.num_embedders):
        t[e] = torch.randn(c.sizes[e], c.emb_dim, generator=g), torch.randn(c.hidden_size, c.emb_dim, generator=g)
        ng.load_weight(f"ngram_embeddings.embedders.{e}.weight", t[e][0])
        ng.load_weight(f"ngram_embeddings.post_projs.{e}.weight", t[e][1])
    assert ng._offsets == c.offsets + [sum(c.sizes)]
    st = object.__new__(vm.LongcatNgramModelState)
    st.ngram, st.n, st.ctx_len, st.eos_id = ng, c.emb_neighbor_num, c.emb_neighbor_num - 1, c.eos_token_id
    st.token_context = torch.full((4, st.ctx_len), -1, dtype=torch.int32)
    rng = np.random.default_rng(5)
    seqs = [sequence(rng, c.vocab_size, c.eos_token_id, 20) for _ in range(3)]
    done = [0, 7, 0]  # request 1 resumes after 7 computed ids (mid-sequence)
    slots = [3, 0, 1]
    for r, s in enumerate(slots):
        st.add_request(s, SimpleNamespace(num_computed_tokens=done[r], prefill_token_ids=seqs[r],
                                          prompt_token_ids=seqs[r]))
    from engram.tables.trainable import InRamTable

    ours = lc.NgramEmbedding(lc.hash_mapping(cfg), InRamTable(torch.cat([t[e][0] for e in t])), word.weight.detach(),
                             torch.stack([t[e][1].T for e in t]), dtype=torch.float32)
    for step in ([5, 4, 1], [1, 3, 6], [1, 1, 1], [6, 5, 4]):  # ids per request this step (prefill chunks, decode)
        parts = [seqs[r][done[r]:done[r] + step[r]] for r in range(3)]
        flat = torch.tensor([v for p in parts for v in p])
        qsl = torch.tensor(np.concatenate([[0], np.cumsum([len(p) for p in parts])]), dtype=torch.int32)
        batch = SimpleNamespace(num_tokens=len(flat), num_reqs=3, idx_mapping=torch.tensor(slots),
                                query_start_loc=qsl, input_ids=flat)
        want = st._compute_oe_ids(batch)  # (tokens, E)
        want_emb = ng.embed_batched(flat, want)
        for r in range(3):
            hist = torch.tensor([seqs[r][max(0, done[r] - st.ctx_len):done[r]]])
            got = ours.mapping.hash_continuation(torch.tensor([parts[r]]), hist, offsets=True)[0][0]
            assert got.long().tolist() == want[qsl[r]:qsl[r + 1]].tolist()
            emb = ours(torch.tensor([parts[r]]), history=hist)[0]
            assert (emb - want_emb[qsl[r]:qsl[r + 1]]).abs().max() < 1e-5
            done[r] += step[r]
