"""Adapter training step time: Engram adapter vs LoRA-only on the same frozen base, one process.

The base is a Llama of the `cpu-small` shape (hidden 256, 4 layers, SwiGLU 768, BPE vocab 8192,
batch 8 x seq 256) built by transformers. Variants, each a full optimizer step (forward, backward,
AdamW on dense trainable weights, lazy row Adam on tables), interleaved so machine noise hits all:

    lora               LoRA rank 16 on q_proj/v_proj (PEFT), base frozen: the baseline
    lora+engram        the same LoRA plus an Engram adapter at layer 1 (2 orders x 4 heads x ~65k rows x 32 dims)
    engram             the Engram adapter alone
    engram-reference   the same adapter math written the reference way (numpy hashing, per-branch
                       loops, nn.Conv1d, dense table gradient + dense Adam over the whole table),
                       run through the same hooks: what a straightforward port costs

Prints a table and the ratios (anchor: engram-peft measures LoRA + Engram at +8% over LoRA on
TinyLlama-1.1B), then one JSON line.

    python benchmarks/bench_adapter.py [--steps 8]
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from _reference import RefEngram

import engram
from engram import adapters as ad
from engram.training.data import load_manifest, prepare
from engram.training.optim import build_optimizers

ENGRAM = dict(engram_vocab_size=[65536, 65536], n_embed_per_ngram=128, n_head_per_ngram=4)


def base_model(vocab):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=1, use_cache=False))


def reference_adapter(model, mapping, layer_id):
    """The reference-style Engram in front of decoder layer `layer_id` (hashing inside the hook, as the demo)."""
    ref = RefEngram(layer_id, mapping, model.config.hidden_size, hc_mult=1)
    with torch.no_grad():
        ref.value_proj.weight.zero_()
        ref.value_proj.bias.zero_()
    model.add_module("ref_engram", ref)
    box = {}
    model.model.register_forward_pre_hook(lambda m, a, kw: box.__setitem__("ids", kw["input_ids"]), with_kwargs=True)

    def hook(module, args, kwargs):
        h = args[0]
        return (h + ref(h.unsqueeze(2), input_ids=box["ids"]).squeeze(2),) + args[1:], kwargs

    model.model.layers[layer_id].register_forward_pre_hook(hook, with_kwargs=True)
    return model


def trainable(model) -> tuple[int, int]:
    """(dense, table) trainable parameters."""
    dense = table = 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            is_table = "multi_head_embedding" in n or "ref_engram.embedding" in n
            table += p.numel() if is_table else 0
            dense += 0 if is_table else p.numel()
    return dense, table


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    tok = Path(load_manifest(prepare(None, "bpe:8192", progress=False))["tokenizer_file"])
    vocab = 8192
    ids = torch.randint(2, vocab, (8, 256))
    variants = {}
    for name in ("lora", "lora+engram", "engram", "engram-reference"):
        m = base_model(vocab)
        if name in ("lora+engram", "engram"):
            engram.attach(m, [1], tokenizer=tok, **ENGRAM)
        ad.freeze_base(m)
        if name == "engram-reference":
            probe = engram.attach(base_model(vocab), [1], tokenizer=tok, **ENGRAM)
            reference_adapter(m, ad.adapter_of(probe).mapping, 1)
            opts = {"adam": torch.optim.Adam([p for p in m.parameters() if p.requires_grad], lr=1e-3)}
        else:
            if "lora" in name:
                m = ad.add_lora(m, rank=args.rank)
            opts = build_optimizers(m, 1e-3, weight_decay=0.0)
        variants[name] = (m.train(), opts)

    def step(name):
        m, opts = variants[name]
        loss = m(input_ids=ids, labels=ids).loss
        for o in opts.values():
            o.zero_grad(set_to_none=True)
        loss.backward()
        for o in opts.values():
            o.step()

    times = {k: [] for k in variants}
    for k in variants:
        step(k)  # warm-up (allocations, numba compile)
    for _ in range(args.steps):
        for k in variants:
            t = time.perf_counter()
            step(k)
            times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    counts = {k: trainable(m) for k, (m, _) in variants.items()}
    print(f"adapter training step: Llama hidden 256 x 4 layers, vocab {vocab}, batch 8 x seq 256, "
          f"threads {torch.get_num_threads()}, {args.steps} interleaved steps (median)")
    print(f"{'variant':<18} {'s/step':>8} {'tok/s':>8} {'trainable dense':>16} {'table params':>13}")
    for k in variants:
        dense, table = counts[k]
        print(f"{k:<18} {med[k]:>8.3f} {ids.numel() / med[k]:>8.0f} {dense:>16,} {table:>13,}")
    r = {"lora_engram_over_lora": med["lora+engram"] / med["lora"] - 1,
         "engram_over_lora": med["engram"] / med["lora"] - 1,
         "reference_over_ours": med["engram-reference"] / med["engram"]}
    print(f"LoRA + Engram vs LoRA: {r['lora_engram_over_lora']:+.1%} step time (engram-peft on TinyLlama-1.1B: +8%)")
    print(f"Engram adapter vs LoRA: {r['engram_over_lora']:+.1%}; reference-style adapter / ours: "
          f"{r['reference_over_ours']:.2f}x")
    print(json.dumps({"bench": "adapter", **{k: round(v, 4) for k, v in r.items()},
                      "s_per_step": {k: round(v, 4) for k, v in med.items()}}))


if __name__ == "__main__":
    main()
