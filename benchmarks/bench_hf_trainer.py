"""Training step of an Engram adapter three ways, one process: `engram adapt`, transformers.Trainer, your own loop.

The same frozen base (a Llama of the `cpu-small` shape: hidden 256, 4 layers, SwiGLU 768, BPE vocab 8192), the
same adapter (layer 1, 2 orders x 4 heads x 65,536 rows x 32 dims, as benchmarks/bench_adapter.py), the same
initialization and batch shape (8 x 256 tokens of Shakespeare), the same learning rate and clipping at 1.0:

    adapt     `engram adapt`'s step (`training.run.train_step` on the run `training.adapt.build` makes): AdamW on the
              Engram dense weights, lazy row Adam on the tables (the fused kernel sums repeated rows in place),
              dense weights clipped (the tables' rows are not in its norm)
    trainer   `transformers.Trainer(..., optimizers=engram.hf_optimizers(model, args))` with default arguments
              otherwise: its data loader, clipping of model.parameters() (table rows in the global norm),
              EngramAdamW, LR scheduler, callbacks
    loop      your own loop: forward, backward, `torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`,
              EngramAdamW (`hf_optimizers(model)[0]`) step, zero_grad

The three interleave step by step (a Trainer callback runs one `adapt` and one `loop` step after each Trainer
step, order alternating; 2 warm-up steps left out); each round's total time gives a ratio to `adapt`, by
the wall clock and by the process's CPU time (all threads: what a step costs, less sensitive than the wall clock
to other processes on a shared machine). Prints the ratios (min..max over rounds), then one JSON line.

    python benchmarks/bench_hf_trainer.py [--steps 5] [--rounds 4]
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import engram
from engram.inference import load_base
from engram.persist import remove_tree
from engram.training.adapt import build
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
    ap.add_argument("--steps", type=int, default=5, help="steps per variant per round")
    ap.add_argument("--rounds", type=int, default=4)
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
    train = load_split(run.data_dir, "train")
    toks = torch.from_numpy(train[: len(train) // T * T].astype("int64")).view(-1, T)  # (windows, T)
    data = [{"input_ids": x, "labels": x} for x in toks[torch.randperm(len(toks), generator=torch.Generator()
                                                                         .manual_seed(0))]]
    targs = TrainingArguments(str(root / "trainer"), per_device_train_batch_size=B, learning_rate=tcfg.lr,
                              max_grad_norm=tcfg.grad_clip, max_steps=1, lr_scheduler_type="constant",
                              save_strategy="no", logging_steps=10**6, report_to=[], use_cpu=True, disable_tqdm=True,
                              dataloader_drop_last=True)
    # your own loop
    loop_model = attached(base_dir, tcfg.seed)
    loop_opt, _ = engram.hf_optimizers(loop_model, targs)
    batches = iter(data[::-1])

    def loop_step():
        ids = torch.stack([next(batches)["input_ids"] for _ in range(B)])
        loss = loop_model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(loop_model.parameters(), tcfg.grad_clip)
        loop_opt.step()
        loop_opt.zero_grad(set_to_none=True)

    def adapt_step():
        train_step(run, adapt_step.n)
        adapt_step.n += 1

    adapt_step.n = 0
    others = {"adapt": adapt_step, "loop": loop_step}
    wall = {"adapt": [], "trainer": [], "loop": []}  # seconds per step
    cpu = {"adapt": [], "trainer": [], "loop": []}  # the process's CPU seconds (all threads) per step

    def clocks():
        return time.perf_counter(), time.process_time()

    class Interleave(TrainerCallback):
        """After each Trainer step, one `engram adapt` step and one own-loop step (order alternating): machine
        noise hits the three alike. The Trainer's step is the time from this callback's end to its next call."""
        last_end = None

        def on_step_end(self, a, state, control, **kw):
            t0 = clocks()
            if self.last_end is not None:
                wall["trainer"].append(t0[0] - self.last_end[0])
                cpu["trainer"].append(t0[1] - self.last_end[1])
            names = list(others) if state.global_step % 2 else list(reversed(others))
            for k in names:
                t = clocks()
                others[k]()
                t1 = clocks()
                wall[k].append(t1[0] - t[0])
                cpu[k].append(t1[1] - t[1])
            self.last_end = clocks()

    warm = 2  # steps left out: numba compiles, allocations, the Trainer's first setup
    targs.max_steps = warm + args.rounds * args.steps + 1
    trainer = Trainer(model=tr_model, args=targs, train_dataset=data, callbacks=[Interleave()],
                      optimizers=engram.hf_optimizers(tr_model, targs))
    trainer.train()
    print(f"adapter training step, Llama hidden 256 x 4 layers, vocab 8192, adapter {ENGRAM} at layers {LAYERS}, "
          f"batch {B} x {T}, threads {torch.get_num_threads()}; {args.rounds} rounds x {args.steps} interleaved steps")
    out = {"bench": "hf_trainer", "threads": torch.get_num_threads()}
    for clock, times in (("wall", wall), ("cpu", cpu)):
        times = {k: v[-args.rounds * args.steps:] for k, v in times.items()}
        rounds = {k: [sum(v[r * args.steps:(r + 1) * args.steps]) for r in range(args.rounds)]
                  for k, v in times.items()}  # a round's total time, per variant
        ratio = {k: [t / a for t, a in zip(rounds[k], rounds["adapt"])] for k in ("trainer", "loop")}
        mean = {k: statistics.mean(v) for k, v in times.items()}
        print(f"{clock + ' clock':<11} {'s/step (mean)':>14} {'/ adapt, per round: min..max (median)':>40}")
        for k in times:
            rr = ratio.get(k)
            span = f"{min(rr):.2f}..{max(rr):.2f} ({statistics.median(rr):.2f})" if rr else "1"
            print(f"  {k:<9} {mean[k]:>14.3f} {span:>40}")
        out[clock] = {"s_per_step": {k: round(v, 4) for k, v in mean.items()},
                      **{f"{k}_over_adapt": [round(x, 3) for x in ratio[k]] for k in ratio},
                      "steps": {k: [round(x, 3) for x in v] for k, v in times.items()}}
    print(json.dumps(out))
    remove_tree(root)


if __name__ == "__main__":
    main()
