"""GPU: Engram tables in pinned host memory with prefetch vs the same tables on the device.

Model: hidden 1024, 8 layers, Engram at block 1 with 2 x 8 heads x ~2M rows x 64 dims (~8.6 GB
fp32 on the host side). Same inputs both ways; logits compared. Needs CUDA (run through
`benchmarks/gpu_offload.sh` on a lent GPU machine). Ends with one JSON line (`throughput_ratio`).
"""

import json
import statistics
import sys
import time

import torch


def main():
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_offload: needs a CUDA device (this measures pinned-host tables vs on-device tables)")
    from engram.model import EngramForCausalLM
    from engram.tables import InRamTable, Prefetcher, find_tables, install
    from engram.training import presets

    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 2_000_003
    torch.manual_seed(0)
    cfg = presets.cpu_small(vocab_size=32768, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                            num_key_value_heads=4, intermediate_size=2816,
                            engram=dict(engram_vocab_size=[rows, rows], n_embed_per_ngram=512, n_head_per_ngram=8,
                                        layer_ids=[1]))
    model = EngramForCausalLM(cfg).eval()
    batches = [torch.randint(2, 32768, (8, 1024)) for _ in range(12)]
    dev = torch.device("cuda")

    def run(prefetch):
        ts = []
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            nxt = prefetch.submit(batches[0]) if prefetch else None
            for i, ids in enumerate(batches):
                torch.cuda.synchronize()
                t = time.perf_counter()
                cur = nxt
                if prefetch and i + 1 < len(batches):
                    nxt = prefetch.submit(batches[i + 1])
                logits = model(ids.to(dev), engram_rows=cur).logits
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t)
        return logits.float().cpu(), statistics.median(ts[2:])

    model.to(dev)
    ref, t_dev = run(None)
    for _, mhe in find_tables(model):  # tables to pinned host memory, gathered on the host and copied ahead
        install(mhe, InRamTable(mhe.embedding.weight.detach().cpu().pin_memory()))
    torch.cuda.empty_cache()
    pf = Prefetcher(model, device=dev)
    out, t_host = run(pf)
    pf.close()
    ntok = batches[0].numel()
    print(f"on-device tables: {ntok / t_dev:,.0f} tok/s; pinned-host + prefetch: {ntok / t_host:,.0f} tok/s; "
          f"max |logit diff| {float((out - ref).abs().max()):.2e}")
    print(json.dumps({"bench": "gpu_offload", "device": torch.cuda.get_device_name(),
                      "tok_s_device": round(ntok / t_dev),
                      "tok_s_host_prefetch": round(ntok / t_host), "throughput_ratio": round(t_dev / t_host, 4)}))


if __name__ == "__main__":
    main()
