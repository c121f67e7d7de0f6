"""Qwen4Exp (Qwen3.8-Flash-Next architecture) prefill and decode with its n-gram table in three places, one process.

A small random backbone (hidden 256, 4 layers, one PLE layer) with a ~2 GB n-gram table (16 heads x ~2M
rows x 16 dims, float32), the table:
    transformers   in the model's own `nn.Embedding`, hashed by transformers' torch code (the reference)
    engram-ram     `serve_tables(tier="ram")`: the same tensor, engram's kernel, prefetch thread
    engram-mmap    `serve_tables(tier="mmap")`: memory-mapped file (warm page cache), prefetch thread
One model; the n-gram module is swapped between rounds, rounds interleaved. Prefill: B x T tokens,
one forward. Decode: greedy `generate()` of N tokens after a short prompt. Outputs are checked
identical. Target: mmap + prefetch >= 0.97x the in-RAM prefill tokens/s.

    python benchmarks/bench_qwen4_serve.py [--base 2000000 --batch 4 --seq 512 --new 32 --rounds 5]
"""

import argparse
import json
import statistics
import tempfile
import time

import torch
from transformers.models.qwen4_exp import modeling_qwen4_exp as mq
from transformers.models.qwen4_exp.configuration_qwen4_exp import Qwen4ExpTextConfig

from engram.integrations.qwen4_exp import serve_tables


def build(base: int):
    cfg = Qwen4ExpTextConfig(
        vocab_size=32000, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, ple_layer_ids=[2], layer_types=["linear_attention", "linear_attention", "linear_attention",
                                                     "full_attention"],
        eos_token_id=2, heads_per_ngram=8, ple_embed_dim=256, ngram_vocab_size_base=base, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, num_experts=8, num_experts_per_tok=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, hc_lowrank=16,
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=64, indexer_budget=256, indexer_compress_ratio=4,
        split_ngram_parts=8, use_cache=True)
    torch.manual_seed(0)
    return mq.Qwen4ExpForCausalLM(cfg).eval()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", type=int, default=2_000_000, help="ngram_vocab_size_base: rows per head")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = build(args.base)
    ple = model.model.layers[1].ple
    w = ple.ple_embedding.ngram_embedding.weight
    print(f"built in {time.perf_counter() - t0:.0f} s: n-gram table {tuple(w.shape)} {w.dtype} = "
          f"{w.numel() * w.element_size() / 2**30:.2f} GiB, threads {torch.get_num_threads()}")
    modules = {"transformers": ple.ple_embedding}
    tmp = tempfile.TemporaryDirectory()
    serve_tables(model, tier="ram")
    modules["engram-ram"] = ple.ple_embedding
    ple.ple_embedding = modules["transformers"]
    serve_tables(model, tier="mmap", dir=tmp.name)
    modules["engram-mmap"] = ple.ple_embedding
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 32000, (args.batch, args.seq), generator=g)
    prompt = ids[:, :16]

    def prefill(name):
        ple.ple_embedding = modules[name]
        with torch.no_grad():
            return model(ids, use_cache=False).logits

    def decode(name):
        ple.ple_embedding = modules[name]
        return model.generate(prompt, max_new_tokens=args.new, do_sample=False, pad_token_id=0)

    ref_logits, ref_tokens = prefill("transformers"), decode("transformers")
    for name in modules:  # warm-up (page cache, kernels) and identical outputs
        assert torch.equal(prefill(name), ref_logits), f"{name}: prefill logits differ"
        assert torch.equal(decode(name), ref_tokens), f"{name}: generated tokens differ"
    t = {k: {"prefill": [], "decode": []} for k in modules}
    for _ in range(args.rounds):
        for name in modules:
            s = time.perf_counter()
            prefill(name)
            t[name]["prefill"].append(ids.numel() / (time.perf_counter() - s))
            s = time.perf_counter()
            decode(name)
            t[name]["decode"].append(args.batch * args.new / (time.perf_counter() - s))
    med = {k: {p: statistics.median(v) for p, v in d.items()} for k, d in t.items()}
    print(f"prefill B={args.batch} T={args.seq}; decode B={args.batch} x {args.new} new tokens; median of "
          f"{args.rounds} interleaved rounds; outputs identical")
    print(f"{'table':<14} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for k, v in med.items():
        print(f"{k:<14} {v['prefill']:>14.0f} {v['decode']:>13.1f}")
    r = {"mmap_over_ram_prefill": med["engram-mmap"]["prefill"] / med["engram-ram"]["prefill"],
         "ram_over_transformers_prefill": med["engram-ram"]["prefill"] / med["transformers"]["prefill"],
         "ram_over_transformers_decode": med["engram-ram"]["decode"] / med["transformers"]["decode"],
         "mmap_over_ram_decode": med["engram-mmap"]["decode"] / med["engram-ram"]["decode"]}
    print(f"mmap + prefetch / in-RAM prefill: {r['mmap_over_ram_prefill']:.3f}x (target >= 0.97); engram-ram / "
          f"transformers: prefill {r['ram_over_transformers_prefill']:.2f}x, "
          f"decode {r['ram_over_transformers_decode']:.2f}x")
    print(json.dumps({"bench": "qwen4_serve", **{k: round(v, 3) for k, v in r.items()},
                      "tok_s": {k: {p: round(x, 1) for p, x in v.items()} for k, v in med.items()},
                      "table_gib": round(w.numel() * w.element_size() / 2**30, 2)}))


if __name__ == "__main__":
    main()
