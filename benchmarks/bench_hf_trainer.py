"""Training step of an Engram adapter three ways, one process: `engram adapt`, transformers.Trainer, your own loop.

The same frozen base (a Llama of the `cpu-small` shape: hidden 256, 4 layers, SwiGLU 768, BPE vocab 8192), the
same adapter (layer 1, 2 orders x 4 heads x 65,536 rows x 32 dims, as benchmarks/bench_adapter.py), the same
initialization and batch shape (8 x 256 tokens of Shakespeare), the same learning rate and clipping at 1.0:

    adapt     `engram adapt`'s step (`training.run.train_step` on the run `training.adapt.build` makes): AdamW on the
              Engram dense weights, lazy row Adam on the tables (the fused kernel sums repeated rows in place),
              dense weights clipped (the tables' rows are not in its norm)
    trainer   `transformers.Trainer(..., optimizers=engram.hf_optimizers(model, args))` with default arguments
              otherwise: its data loader, clipping of model.parameters() (table rows in the global norm),
              EngramAdamW, LR scheduler, callbacks; timed between consecutive `on_step_end`s
    loop      your own loop: forward, backward, `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`,
              EngramAdamW (`hf_optimizers(model)[0]`) step, zero_grad

Rounds interleave the three (one warm-up round first); each round's median step time gives a ratio to `adapt`.
Prints the per-round ratios (min..max over rounds), then one JSON line.

    python benchmarks/bench_hf_trainer.py [--steps 6] [--rounds 5]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engram
from engram.training.adapt import build, load_base
from engram.training.data import load_manifest, load_split, prepare
from engram.training.run import train_step

ENGRAM = dict(engram_vocab_size=[65536, 65536], n_embed_per_ngram=128, n_head_per_ngram=4)
LAYERS = [1]


def save_base(root: Path) -> Path:
    """The base as `engram adapt --base` takes it: a save_pretrained folder with its tokenizer.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Path(load_manifest(prepare(None, "bpe:8192", progress=False))["tokenizer_file"])
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
                                     bos_token_id=0, eos_token_id=0, pad_token_id=1, use_cache=False))
    d = root / "base"
    m.save_pretrained(d)
    (d / "tokenizer.json").write_bytes(tok.read_bytes())
    return d


def attached(base_dir: Path, seed: int):
    """The base with the adapter attached under the seed `engram adapt` draws it with: the same init."""
    model, tok = load_base(base_dir)
    torch.manual_seed(seed)
    return engram.attach(model, LAYERS, tokenizer=tok, verbose=False, **ENGRAM).train()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    from transformers import Trainer, TrainerCallback, TrainingArguments

    root = Path(tempfile.mkdtemp(prefix="bench_hf_trainer."))
    base_dir = save_base(root)
    run = build(base_dir, None, root / "adapt", layers=LAYERS, engram_options=ENGRAM, max_steps=10**6,
                progress=False)
    tcfg = run.tcfg
    B, T = tcfg.batch_size, tcfg.seq_len

    # the Trainer: default arguments but for the batch, LR, run length and logging
    tr_model = attached(base_dir, tcfg.seed)
    toks = torch.from_numpy(load_split(run.data_dir, "train")[: (len(load_split(run.data_dir, "train")) // T) * T]
                            .astype("int64")).view(-1, T)
    data = [{"input_ids": x, "labels": x} for x in toks[torch.randperm(len(toks), generator=torch.Generator()
                                                                         .manual_seed(0))]]
    targs = TrainingArguments(str(root / "trainer"), per_device_train_batch_size=B, learning_rate=tcfg.lr,
                              max_grad_norm=tcfg.grad_clip, max_steps=args.steps, lr_scheduler_type="constant",
                              save_strategy="no", logging_steps=10**6, report_to=[], use_cpu=True, disable_tqdm=True,
                              dataloader_drop_last=True)
    stamps: list[float] = []

    class Stamp(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            stamps.append(time.perf_counter())

    trainer = Trainer(model=tr_model, args=targs, train_dataset=data, callbacks=[Stamp()],
                      optimizers=engram.hf_optimizers(tr_model, targs))

    # your own loop
    loop_model = attached(base_dir, tcfg.seed)
    loop_opt, _ = engram.hf_optimizers(loop_model, targs)
    batches = iter(data)

    def loop_step():
        ids = torch.stack([next(batches)["input_ids"] for _ in range(B)])
        loss = loop_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(loop_model.parameters(), tcfg.grad_clip)
        loop_opt.step()
        loop_opt.zero_grad(set_to_none=True)

    step = [0]

    def adapt_round() -> float:
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            train_step(run, step[0])
            step[0] += 1
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def trainer_round() -> float:
        stamps.clear()
        trainer.train()
        return statistics.median(b - a for a, b in zip(stamps, stamps[1:]))  # step 1 (setup) left out

    def loop_round() -> float:
        times = []
        for _ in range(args.steps):
            t = time.perf_counter()
            loop_step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    variants = {"adapt": adapt_round, "trainer": trainer_round, "loop": loop_round}
    for fn in variants.values():  # warm-up: numba compiles, allocations, the Trainer's first setup
        fn()
    per_round = {k: [] for k in variants}
    for r in range(args.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))  # machine noise hits all alike
        for k in order:
            per_round[k].append(variants[k]())
    ratio = {k: [t / a for t, a in zip(per_round[k], per_round["adapt"])] for k in ("trainer", "loop")}
    med = {k: statistics.median(v) for k, v in per_round.items()}
    print(f"adapter training step, Llama hidden 256 x 4 layers, vocab 8192, adapter {ENGRAM} at layers {LAYERS}, "
          f"batch {B} x {T}, threads {torch.get_num_threads()}; {args.rounds} rounds x {args.steps} steps")
    print(f"{'variant':<9} {'s/step (median)':>16} {'tok/s':>8} {'/ adapt, per round (min..max)':>32}")
    for k in variants:
        rr = ratio.get(k)
        span = f"{min(rr):.2f}..{max(rr):.2f} (median {statistics.median(rr):.2f})" if rr else "1"
        print(f"{k:<9} {med[k]:>16.3f} {B * T / med[k]:>8.0f} {span:>32}")
    print(json.dumps({"bench": "hf_trainer", "s_per_step": {k: round(v, 4) for k, v in med.items()},
                      "trainer_over_adapt": [round(x, 3) for x in ratio["trainer"]],
                      "loop_over_adapt": [round(x, 3) for x in ratio["loop"]], "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
