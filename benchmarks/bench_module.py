"""Engram module speed: engram's `Engram` vs a reference-style module, same weights, same process.

Demo config (hidden 1024, hc_mult 4, 2x8 heads, 10.3M-row table x 64), B=4, T=512 by default.
Both forwards include hashing. The reference-style module loops over branches, uses
`nn.Conv1d` and a dense table gradient (as `engram_demo_v1.py`). Outputs are compared.
Prints a table, then one JSON line.

    python benchmarks/bench_module.py [--batch 4] [--seq 512] [--repeats 3]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _reference import RefEngram  # noqa: E402
from _timing import timeit  # noqa: E402

from engram import BackBoneConfig, Engram, EngramConfig  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layer", type=int, default=1)
    args = ap.parse_args()
    torch.manual_seed(0)
    ecfg, bcfg = EngramConfig(), BackBoneConfig()
    t0 = time.perf_counter()
    ours = Engram(args.layer, ecfg, bcfg)
    ref = RefEngram(args.layer, ours.hash_mapping, bcfg.hidden_size, bcfg.hc_mult, ecfg.kernel_size)
    with torch.no_grad():  # same weights on both sides
        ref.embedding.weight.copy_(ours.multi_head_embedding.embedding.weight)
        D, G = bcfg.hidden_size, bcfg.hc_mult
        ref.value_proj.weight.copy_(ours.kv_proj.weight[:D])
        ref.value_proj.bias.copy_(ours.kv_proj.bias[:D])
        for i in range(G):
            ref.key_projs[i].weight.copy_(ours.kv_proj.weight[(i + 1) * D:(i + 2) * D])
            ref.key_projs[i].bias.copy_(ours.kv_proj.bias[(i + 1) * D:(i + 2) * D])
        ref.short_conv.conv.weight.copy_(ours.short_conv.conv.weight)
    print(f"built both modules in {time.perf_counter() - t0:.1f} s "
          f"(table {ours.multi_head_embedding.embedding.weight.shape[0] / 1e6:.2f}M rows x {ecfg.head_dim})")
    ids = torch.randint(0, 128815, (args.batch, args.seq))
    h = torch.randn(args.batch, args.seq, bcfg.hc_mult, bcfg.hidden_size)
    lid = ours.layer_id

    def on_ids(m, hh):
        """Both sides from token ids: the reference hashes inside forward; ours hashes, looks up, then the math."""
        if m is ref:
            return ref(hh, ids)
        return ours(hh, ours.multi_head_embedding(ours.hash_mapping.hash(ids)[lid]))[0]

    with torch.no_grad():
        diff = (on_ids(ours, h) - on_ids(ref, h)).abs().max().item()

    def fwd(m):
        with torch.no_grad():
            on_ids(m, h)

    def fwd_bwd(m):
        for p in m.parameters():
            p.grad = None
        hh = h.clone().requires_grad_(True)
        on_ids(m, hh).square().mean().backward()

    def fwd_bwd_kept(m):
        # a training loop that keeps .grad buffers (zero_grad(set_to_none=False)): the reference then
        # zeroes and accumulates its dense 662M-float table gradient every step; ours stays sparse.
        for p in m.parameters():
            if p.grad is not None:
                if p.grad.is_sparse:
                    p.grad = None
                else:
                    p.grad.zero_()
        hh = h.clone().requires_grad_(True)
        on_ids(m, hh).square().mean().backward()

    res = {}
    for name, fn in [("forward", fwd), ("forward+backward", fwd_bwd), ("fwd+bwd, grads kept", fwd_bwd_kept)]:
        res[name] = (timeit(lambda: fn(ref), args.repeats), timeit(lambda: fn(ours), args.repeats))
    print(f"module: B={args.batch} T={args.seq}, hidden {bcfg.hidden_size}, hc_mult {bcfg.hc_mult}, "
          f"threads {torch.get_num_threads()}; max |out diff| = {diff:.2e}")
    print(f"{'pass':<22} {'reference s':>12} {'engram s':>10} {'speedup':>8}")
    for name, (tr, to) in res.items():
        print(f"{name:<22} {tr:>12.3f} {to:>10.3f} {tr / to:>8.2f}")
    print(json.dumps({
        "bench": "module", "batch": args.batch, "seq": args.seq,
        "forward_ref_s": round(res["forward"][0], 4), "forward_engram_s": round(res["forward"][1], 4),
        "forward_speedup": round(res["forward"][0] / res["forward"][1], 2),
        "fwd_bwd_ref_s": round(res["forward+backward"][0], 4), "fwd_bwd_engram_s": round(res["forward+backward"][1], 4),
        "fwd_bwd_speedup": round(res["forward+backward"][0] / res["forward+backward"][1], 2),
        "fwd_bwd_kept_speedup": round(res["fwd+bwd, grads kept"][0] / res["fwd+bwd, grads kept"][1], 2),
        "max_abs_diff": diff,
    }))


if __name__ == "__main__":
    main()
