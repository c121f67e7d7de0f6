"""engram against the peers a user would pick instead, in one script: the disk store (EngramDB) and
Engram adapters on transformers models (engram-peft).

    pip install -e '.[hf,fast]' -r benchmarks/requirements-peers.txt   # the peers; never needed by tests or CI
    python benchmarks/bench_peers.py [--part disk|adapters|all] [--rows 2000000] [--rounds 3] [--steps 150]
        [--sides engram:0.02,engram:1,peft,engram-trainer:0.02,engram-trainer:1,peft-trl] [--bases llama,qwen3]
        [--concurrent 1]
        [--record docs/results/bench-peers-NAME.json]

(engram-peft 1.2.7 needs Python >= 3.12: it imports `typing.override`, though it declares >= 3.10.)

Disk store: the same bfloat16 rows (`--rows` x d, for d = 160 as Qwen3.8-Flash-Next's table and d = 256)
written in both formats (engram's disk-tier file: page-aligned safetensors with 4 KiB block sums;
EngramDB's Store: one fixed-width shard file), the same row ids from hashing real text (Shakespeare, 4,096
tokens, 2 orders x 4 heads, offsets folded into the table), each file evicted from the page cache before
a cold round (`posix_fadvise(DONTNEED)`, resident fraction from `mincore`), then warm. engram's
`DiskTable.gather` (checking each block on first read) vs EngramDB's `Store.fetch` and its io_uring page
reader (`IoUringPageReader.read_pages` of the 4 KiB pages holding the rows, then cut out), with the
device's limit in the same run: the best random reads/s of several access patterns by fio (4 KiB and
16 KiB direct reads, psync x32 and io_uring at depths 8-128, buffered reads with and without
read-ahead, `PATTERNS`; and the whole file read sequentially, which wins when the rows are dense). The
bytes returned are compared for equality.

Adapters: the same random Llama and Qwen3 bases (hidden 256, 4 layers, the `exp` preset's BPE-4096
Shakespeare tokenizer), the same Engram table (2 orders x 4 heads x ~10k rows x 32 dims at layer 1, one
stream, zero-initialized conv), the same Shakespeare batches (8 x 128 tokens), steps, base LR (table at 5x),
no weight decay, the base frozen. Sides (`SIDES`, `--sides`):
  engram:0.02, engram:1  `engram.attach` + `build_optimizers` in a plain loop, table rows N(0, 0.02) and N(0, 1):
                         both inits are reported. The default (`default_init()`) was chosen elsewhere, on the
                         settings of `engram experiment adapter-init` (GPT-2 and GPT-NeoX bases, a BPE-2048
                         tokenizer, Shakespeare and KJV, `engram adapt`'s LR; `INIT_CHOSEN_BY`), never on this bench.
  peft                   `engram_peft.get_engram_model` + its `create_optimizer` (SparseAdam rows), plain loop.
  engram-trainer:0.02, engram-trainer:1  `transformers.Trainer` with `optimizers=engram.hf_optimizers(model, args)`,
                         at each init.
  peft-trl               engram-peft's TRL factory `create_engram_sft_trainer` (SFTTrainer; needs TRL < 1.16,
                         whose SFTTrainer patches the model's forward with a fused LM head that EngramModel's
                         output cannot feed; requirements-peers.txt pins TRL 1.2.0). The factory turns on gradient
                         checkpointing; it is turned off again so that both trainers do the same work.
The two trainers get the same arguments: the bench's batches in order (sequential sampling), constant LR,
Trainer's defaults otherwise (clipping at 1.0, AdamW betas). Each (side, base, seed) runs in its own child
process, `--rounds` times, round r with seed r (the base's weights, the batches, the adapter's init): one after
another rotating who goes first, or `--concurrent N` at once in fixed groups (sides of a group share the
machine's load). Reported: step time (median after 3 warm-up steps; Trainer steps timed by a callback),
peak RSS, train loss over the last 10 steps and val loss after `--steps`, max |logit change| at attach, adapter
files' bytes, max |logit difference| after a save/load round trip into a fresh base (Trainer sides: what
`trainer.save_model` wrote), and val-loss comparisons by the project's test (paired t by seed, Holm over the
comparisons of all bases: `engram_experiments.significance`). Prints a table and one JSON line; `--record FILE`
also writes the JSON.
"""

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_disk import compile_readers, evict, fio_read  # noqa: E402

from engram.tables import write_table_file  # noqa: E402
from engram.tables.disk import DiskTable  # noqa: E402

# access patterns for the device limit: (name, fio arguments); rows/s = reads/s, one row per read
PATTERNS = [
    ("4k direct, psync x32", ["--bs=4k", "--direct=1", "--ioengine=psync", "--numjobs=32", "--iodepth=1"]),
    ("4k direct, io_uring qd8", ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=8"]),
    ("4k direct, io_uring qd32", ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=32"]),
    ("4k direct, io_uring qd128", ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=128"]),
    ("4k direct, io_uring qd32 x4 jobs",
     ["--bs=4k", "--direct=1", "--ioengine=io_uring", "--numjobs=4", "--iodepth=32"]),
    ("16k direct, io_uring qd32", ["--bs=16k", "--direct=1", "--ioengine=io_uring", "--numjobs=1", "--iodepth=32"]),
    ("4k buffered, no read-ahead, psync x32", ["--bs=4k", "--direct=0", "--fadvise_hint=1", "--ioengine=psync",
                                                "--numjobs=32", "--iodepth=1"]),
    ("4k buffered, read-ahead, psync x32", ["--bs=4k", "--direct=0", "--fadvise_hint=0", "--ioengine=psync",
                                             "--numjobs=32", "--iodepth=1"]),
]


def device_limits(path: Path, distinct: int, reads: int = 24_576) -> dict:
    """Rows/s the device gives `distinct` random rows of `path` by each access pattern, by fio (none without
    fio): the random patterns of `PATTERNS` (one row per read, so rows/s = reads/s; each starts from an evicted
    file and does `reads` reads in all, few enough that buffered patterns mostly miss the cache), and reading
    the whole file sequentially in 1 MiB direct reads (rows/s = distinct / the time to read it: the best
    pattern when the rows are dense in a small file)."""
    out = {}
    for name, spec in PATTERNS:
        jobs = int(next(a for a in spec if a.startswith("--numjobs=")).split("=")[1])
        evict(path)
        r = fio_read(path, "--rw=randread", *spec, f"--number_ios={reads // jobs}")
        if r is not None:  # (None: no fio, or an engine this kernel lacks)
            out[name] = float(r["iops"])
    evict(path)
    r = fio_read(path, "--rw=read", "--bs=1m", "--direct=1", "--ioengine=io_uring", "--iodepth=8")
    if r is not None:
        out["whole file, 1 MiB sequential direct"] = distinct * float(r["bw_bytes"]) / path.stat().st_size
    return out


def iouring_rows(reader, fd: int, ids: np.ndarray, width: int) -> bytes:
    """Rows `ids` (`width` bytes each) of a fixed-width file through EngramDB's io_uring page reader: the 4 KiB
    pages holding each row (two where a row straddles a page boundary), read in one call, then cut out."""
    start = ids.astype(np.int64) * width
    first, last = start // 4096, (start + width - 1) // 4096
    pages = np.unique(np.concatenate([first, last]))
    blob = np.frombuffer(b"".join(reader.read_pages([fd] * len(pages), (pages * 4096).tolist())), np.uint8)
    pos = np.searchsorted(pages, first) * 4096 + start % 4096  # each row's first byte in the page blob; a
    # straddling row's second page follows its first in `pages` (both are there, sorted, adjacent numbers)
    return np.lib.stride_tricks.sliding_window_view(blob, width)[pos].tobytes()


def real_row_ids(rows: int, tokens: int = 4096) -> torch.Tensor:
    """Row ids of `tokens` Shakespeare tokens hashed by the reference family (2 orders x 4 heads), into `rows`."""
    from engram.hashing import NgramHashMapping
    from engram.tokenizer import load_tokenizer
    from engram.training.corpora import shakespeare_works

    text = "".join(doc.text for doc in shakespeare_works()[:3])
    tok = load_tokenizer(None)
    ids = np.array(tok.encode(text[:200_000], add_special_tokens=False).ids[:tokens])[None]
    per_head = rows // 8
    m = NgramHashMapping([per_head, per_head], 3, 64, 4, [1], None, 2, 0)
    h = m.hash(ids, offsets=True)[1]  # (1, T, 8), rows of one layer's table
    return torch.from_numpy(np.asarray(h)).reshape(-1) % rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", choices=("disk", "adapters", "all"), default="all")
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150, help="adapter training steps")
    ap.add_argument("--dir", help="where to write the files (default: a temp dir)")
    ap.add_argument("--sides", help=f"adapters: comma-separated subset of {','.join(SIDES)} (default: all)")
    ap.add_argument("--bases", default="llama,qwen3", help="adapters: comma-separated subset of llama,qwen3")
    ap.add_argument("--concurrent", type=int, default=1, help="adapters: run the sides in groups of this many at once "
                                                                   "(in --sides order; default 1: one at a time)")
    ap.add_argument("--record", metavar="FILE", help="also write the JSON to FILE (docs/results/bench-peers-*.json)")
    ap.add_argument("--child", nargs=3, metavar=("SIDE", "BASE", "SEED"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        side, kind, seed = args.child
        print(json.dumps(adapter_child(side, kind, steps=args.steps, seed=int(seed))))
        return
    out = {}
    if args.part in ("adapters", "all"):
        out["adapters"] = adapters(args)
    if args.part in ("disk", "all"):
        out["disk"] = disk(args)
    print(json.dumps(out))
    if args.record:
        from engram.persist import write_json

        write_json(Path(args.record), {**out, "command": "python benchmarks/bench_peers.py " + " ".join(sys.argv[1:])})


def disk(args) -> dict:
    import engramdb

    ids = real_row_ids(args.rows)
    ids_np = ids.numpy()
    distinct = torch.unique(ids).numel()
    out = {"bench": "peers_disk", "rows": args.rows, "ids": ids.numel(), "distinct": distinct,
           "engramdb": engramdb.__version__, "results": {}}
    print(f"{ids.numel():,} row ids from hashing 4,096 Shakespeare tokens ({distinct:,} distinct); table {args.rows:,} "
          f"rows; {args.rounds} rounds; EngramDB {engramdb.__version__}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        d = Path(tmp)
        for dim in (160, 256):
            torch.manual_seed(dim)
            W = torch.randn(args.rows, dim).to(torch.bfloat16)
            ours = write_table_file(d / f"engram_{dim}.safetensors", W, page_blocks=True)
            store_dir = d / f"engramdb_{dim}"
            store_dir.mkdir()
            (store_dir / "shard_000.bin").write_bytes(W.view(torch.uint8).numpy().tobytes())
            if dim == 160:
                compile_readers(d, W)
            want = W[ids].view(torch.uint8).reshape(len(ids), -1).numpy().tobytes()
            whos = ("engram", "engramdb", "engramdb_iouring")
            res = {f"{w}_{k}": [] for w in whos for k in ("cold", "warm")} | {"resident": []}
            reader = engramdb.IoUringPageReader()
            for _ in range(args.rounds):
                for who in whos:  # alternating: the machine's drift hits all
                    path = ours if who == "engram" else store_dir / "shard_000.bin"
                    res["resident"].append(evict(path))
                    if who == "engram":
                        table = DiskTable(ours)

                        def fetch(t=table):  # its own output: a (N, d) bfloat16 tensor
                            return t.gather(ids)
                    elif who == "engramdb":
                        table = engramdb.Store(str(store_dir), shards=1, rows_per_shard=args.rows, width=2 * dim)

                        def fetch(t=table):
                            return t.fetch(ids_np)  # bytes, as it returns them
                    else:
                        table = _Fd(path)

                        def fetch(t=table):
                            return iouring_rows(reader, t.fd, ids_np, 2 * dim)
                    t = time.perf_counter()
                    got = fetch()
                    res[f"{who}_cold"].append(distinct / (time.perf_counter() - t))
                    got = got if isinstance(got, bytes) else got.view(torch.uint8).numpy().tobytes()
                    assert got == want, f"{who}: rows differ"
                    t = time.perf_counter()
                    for _ in range(5):
                        fetch()
                    res[f"{who}_warm"].append(5 * len(ids) / (time.perf_counter() - t))
                    table.close()
                    del table, fetch
                    gc.collect()
            fio = device_limits(ours, distinct)
            best = max(fio.values()) if fio else float("nan")
            med = {k: statistics.median(v) for k, v in res.items() if k != "resident"}
            out["results"][dim] = {**{k: [round(x) for x in v] for k, v in res.items() if k != "resident"},
                                   "cold_ratio": round(med["engram_cold"] / med["engramdb_cold"], 3),
                                   "cold_ratio_iouring": round(med["engram_cold"] / med["engramdb_iouring_cold"], 3),
                                   "warm_ratio": round(med["engram_warm"] / med["engramdb_warm"], 3),
                                   "warm_ratio_iouring": round(med["engram_warm"] / med["engramdb_iouring_warm"], 3),
                                   "device_limits": {k: round(v) for k, v in fio.items()},
                                   "engram_cold_vs_best_pattern": round(med["engram_cold"] / best, 3),
                                   "max_resident": None if res["resident"][0] is None else max(res["resident"])}
            r = out["results"][dim]
            print(f"d={dim}: cold rows/s engram {med['engram_cold']:,.0f} vs EngramDB Store.fetch "
                  f"{med['engramdb_cold']:,.0f} ({r['cold_ratio']:.2f}x) vs io_uring pages "
                  f"{med['engramdb_iouring_cold']:,.0f} ({r['cold_ratio_iouring']:.2f}x); warm ids/s "
                  f"{med['engram_warm']:,.0f} vs {med['engramdb_warm']:,.0f} ({r['warm_ratio']:.2f}x) vs "
                  f"{med['engramdb_iouring_warm']:,.0f} ({r['warm_ratio_iouring']:.2f}x); bytes identical; "
                  "resident after "
                  "eviction " + ("n/a" if r["max_resident"] is None else f"{r['max_resident']:.1%}"))
            for name, v in fio.items():
                print(f"    device, {name}: {v:,.0f} rows/s")
            print(f"    engram cold vs the best pattern: {r['engram_cold_vs_best_pattern']:.2f}x")
    return out


class _Fd:
    """An open file descriptor with the tables' close()."""

    def __init__(self, path):
        self.fd = os.open(path, os.O_RDONLY)

    def close(self):
        os.close(self.fd)


# ------------------------------------------------------------------------------------------ adapters
ROWS, HEADS, HEAD_DIM, LAYER, LR, BATCH, SEQ = 10_007, 4, 32, 1, 3e-3, 8, 128
INITS = (0.02, 1.0)  # the adapter tables' init std: both are reported (the default: `default_init()`)
# who trains: engram's own loop at each init, engram-peft's own loop, and both under Hugging Face trainers
SIDES = (*(f"engram:{s:g}" for s in INITS), "peft", *(f"engram-trainer:{s:g}" for s in INITS), "peft-trl")
# what chose the default init (`engram experiment adapter-init`: other bases, tokenizer, data, LR and steps)
INIT_CHOSEN_BY = "docs/results/adapter-init.json (engram experiment adapter-init)"


def default_init() -> float:
    """The table init std `engram.attach` uses unless told (`adapters.default_options`)."""
    from engram.adapters.introspect import default_options

    return default_options(256, 4096)["table_init_std"]


def _base(kind: str, vocab: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=4, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**common))
    return Qwen3ForCausalLM(Qwen3Config(head_dim=64, **common))


def _batches(steps: int, seed: int):
    from engram.training.data import eval_windows, load_split, prepare

    d = prepare(None, "bpe:4096", progress=False)
    train, val = load_split(d, "train"), load_split(d, "val")
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(train) - SEQ, size=(steps, BATCH))
    xs = [torch.from_numpy(np.stack([train[s:s + SEQ] for s in row]).astype(np.int64)) for row in starts]
    return d / "tokenizer.json", xs, torch.from_numpy(eval_windows(val, SEQ, 32).astype(np.int64))


def _peft_config():
    from engram_peft import EngramConfig

    return EngramConfig(engram_vocab_size_per_ngram=[HEADS * ROWS] * 2, ngram_sizes=[2, 3], max_ngram_size=3,
                        n_head_per_ngram=HEADS, embedding_dim=2 * HEADS * HEAD_DIM, target_layers=[LAYER], hc_mult=1,
                        pad_id=1, learning_rate_multiplier=5.0, weight_decay=0.0)


def _trainer_args(cls, out: Path, steps: int, seed: int, **extra):
    """The same arguments for both Hugging Face trainers: the batches in the bench's order (sequential sampling
    of the same windows), constant LR, no decay, Trainer's defaults otherwise (clipping at 1.0, AdamW betas)."""
    return cls(output_dir=str(out), per_device_train_batch_size=BATCH, max_steps=steps, learning_rate=LR,
               weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no",
               report_to=[], seed=seed, train_sampling_strategy="sequential", dataloader_num_workers=0,
               disable_tqdm=True, use_cpu=True, **extra)


def _step_timer():
    """A TrainerCallback timing each optimizer step (data, forward, backward, clipping, update, scheduler)."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    return Timer()


def adapter_child(side: str, kind: str, steps: int, seed: int) -> dict:
    """One (side, base, seed) run in this process: attach, exactness, `steps` steps, val loss, save, reload.
    The seed draws the base's weights, the batches and (through torch's generator) the adapter's init.
    Sides: `engram:STD` (engram's loop, `build_optimizers`, table rows N(0, STD)), `peft` (engram-peft's loop with its
    `create_optimizer`), `engram-trainer:STD` (`transformers.Trainer` with `optimizers=engram.hf_optimizers`),
    `peft-trl` (engram-peft's `create_engram_sft_trainer`, TRL's SFTTrainer; the factory turns on
    gradient checkpointing, turned off again so both trainers do the same work)."""
    import resource
    import shutil

    tok_path, xs, val = _batches(steps, seed)
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size()
    model = _base(kind, vocab, seed).train()
    probe = val[:2]
    with torch.no_grad():
        before = model(input_ids=probe).logits
    engram_side = side.startswith("engram")
    std = float(side.split(":")[1]) if engram_side else 0.02  # (engram-peft's rows: N(0, 0.02))
    tmp = Path(tempfile.mkdtemp())
    trainer = None
    if engram_side:
        import engram

        engram.attach(model, [LAYER], tokenizer=tok_path, verbose=False, engram_vocab_size=[ROWS, ROWS],
                      n_head_per_ngram=HEADS, n_embed_per_ngram=HEADS * HEAD_DIM, max_ngram_size=3, pad_id=1,
                      table_init_std=std)
        net = model
    else:
        from engram_peft import get_engram_model
        from transformers import PreTrainedTokenizerFast

        hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), pad_token="<|pad|>", eos_token="<|endoftext|>")
        net = get_engram_model(model, _peft_config(), tokenizer=hf_tok, train_mode="engram_only")
    with torch.no_grad():
        exact = (net(input_ids=probe).logits - before).abs().max().item()
    trainable = sum(p.numel() for p in net.parameters() if p.requires_grad)
    times, losses = [], []
    if side.startswith("engram-trainer") or side == "peft-trl":
        timer = _step_timer()
        windows = [w for x in xs for w in x]
        if engram_side:
            from transformers import Trainer, TrainingArguments

            targs = _trainer_args(TrainingArguments, tmp / "trainer", steps, seed)
            trainer = Trainer(model=net, args=targs, train_dataset=[{"input_ids": w, "labels": w} for w in windows],
                              optimizers=engram.hf_optimizers(net, targs), callbacks=[timer])
        else:
            from datasets import Dataset
            from engram_peft.trl import create_engram_sft_trainer
            from trl import SFTConfig

            targs = _trainer_args(SFTConfig, tmp / "trainer", steps, seed, max_length=SEQ, packing=False,
                                  dataset_kwargs={"skip_prepare_dataset": True})
            ds = Dataset.from_dict({"input_ids": [w.tolist() for w in windows]})
            trainer = create_engram_sft_trainer(net, hf_tok, train_dataset=ds, args=targs, callbacks=[timer])
            net.gradient_checkpointing_disable() if hasattr(net, "gradient_checkpointing_disable") else \
                net.base_model.gradient_checkpointing_disable()
        trainer.train()
        times = timer.times
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    else:
        if engram_side:
            from engram.training.optim import build_optimizers

            opts = list(build_optimizers(net, LR, weight_decay=0.0).values())
        else:
            opts = [net.create_optimizer(base_learning_rate=LR)]
        for x in xs:
            t = time.perf_counter()
            loss = net(input_ids=x, labels=x).loss
            for o in opts:
                o.zero_grad(set_to_none=True)
            loss.backward()
            for o in opts:
                o.step()
            times.append(time.perf_counter() - t)
            losses.append(loss.item())
    net.eval()
    with torch.no_grad():
        val_loss = statistics.fmean(net(input_ids=val[i:i + 8], labels=val[i:i + 8]).loss.item()
                                    for i in range(0, len(val), 8))
        trained = net(input_ids=probe).logits
    def save(folder: Path, how: str) -> float:
        t = time.perf_counter()
        if how == "trainer":  # what a Trainer user saves: the adapter (engram) / the wrapped model (peft)
            trainer.save_model(str(folder))
        elif engram_side:
            engram.save_adapter(net, folder)
        else:
            net.save_pretrained(str(folder))
        return time.perf_counter() - t

    def load(folder: Path):
        fresh = _base(kind, vocab, seed).eval()
        if engram_side:
            return engram.load_adapter(fresh, folder).eval()
        from engram_peft import EngramModel

        return EngramModel.from_pretrained(fresh, str(folder), tokenizer=hf_tok).eval()

    save_model_error = None
    try:
        save_s = save(tmp / "a", "trainer" if trainer is not None else "own")
        t = time.perf_counter()
        try:
            again = load(tmp / "a")
        except Exception as e:  # the trainer's save_model output does not load back: say so, round-trip the own save
            if trainer is None:
                raise
            save_model_error = f"{type(e).__name__}: {e}"
            shutil.rmtree(tmp / "a")
            save_s = save(tmp / "a", "own")
            t = time.perf_counter()
            again = load(tmp / "a")
        load_s = time.perf_counter() - t
        size = sum(f.stat().st_size for f in (tmp / "a").rglob("*") if f.is_file())
        with torch.no_grad():
            roundtrip = (again(input_ids=probe).logits - trained).abs().max().item()
    finally:
        shutil.rmtree(tmp)
    return {"side": side, "base": kind, "seed": seed, "table_init_std": std, "step_s": statistics.median(times[3:]),
            "train_loss_last10": statistics.fmean(losses[-10:]),
            "val_loss": val_loss, "exact_at_attach": exact, "trainable": trainable, "adapter_bytes": size,
            "save_s": save_s, "load_s": load_s, "roundtrip_max_diff": roundtrip,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **({"save_model_error": save_model_error} if save_model_error else {})}


# the comparisons of val loss the bench tests (b - a, paired by seed; Holm over them and both bases)
def _comparisons(default: str) -> list[tuple[str, str]]:
    other = next(s for s in SIDES if s.startswith("engram:") and s != default)
    d, o = default.split(":")[1], other.split(":")[1]
    return [("peft", default), ("peft", other), (other, default), ("peft-trl", f"engram-trainer:{d}"),
            ("peft-trl", f"engram-trainer:{o}")]


def adapters(args) -> dict:
    import subprocess
    from importlib.metadata import version

    import engram_peft  # noqa: F401  (fail here, not in a child, if the peer is missing)

    sides = args.sides.split(",") if args.sides else list(SIDES)
    bases = args.bases.split(",")
    runs = []
    n = args.concurrent
    for r in range(args.rounds):
        for kind in bases:
            # one after another, rotating who goes first (the machine's drift hits all); or in fixed groups of
            # `--concurrent` at once (the sides of a group share whatever the machine does meanwhile)
            order = sides[r % len(sides):] + sides[:r % len(sides)] if n == 1 else sides
            for group in (order[i:i + n] for i in range(0, len(order), n)):
                procs = [(side, subprocess.Popen([sys.executable, __file__, "--child", side, kind, str(r), "--steps",
                                                  str(args.steps)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 text=True)) for side in group]
                for side, p in procs:
                    stdout, stderr = p.communicate()
                    if p.returncode:
                        raise SystemExit(f"{side} on {kind} failed:\n{stderr[-3000:]}")
                    runs.append(json.loads(stdout.strip().splitlines()[-1]))
                    print(f"round {r} {kind:5s} {side:14s}: " + ", ".join(
                        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in runs[-1].items()
                        if k not in ("side", "base")), flush=True)
    from engram.utils import environment
    from engram_experiments.runs import seed_stats
    from engram_experiments.significance import compare, describe, holm

    default = f"engram:{default_init():g}"
    out = {"engram_peft": version("engram-peft"), "trl": version("trl"), "steps": args.steps, "rounds": args.rounds,
           "sides": sides,
           "default_init": default_init(), "init_chosen_by": INIT_CHOSEN_BY, "runs": runs, "bases": {},
           "environment": environment()}
    tests = []
    for kind in bases:
        by = {s: sorted((x for x in runs if x["base"] == kind and x["side"] == s), key=lambda x: x["seed"])
              for s in sides}
        b = {"val_loss": {s: seed_stats([x["val_loss"] for x in rs]) for s, rs in by.items()},
             "step_s": {s: [x["step_s"] for x in rs] for s, rs in by.items()}}
        for k in ("exact_at_attach", "roundtrip_max_diff", "peak_rss_mib"):
            b[k] = {s: max(x[k] for x in rs) for s, rs in by.items()}
        for k in ("adapter_bytes", "trainable"):
            b[k] = {s: rs[0][k] for s, rs in by.items()}
        for a, c in (("peft", default), ("peft-trl", f"engram-trainer:{default_init():g}")):
            if a in by and c in by:
                b[f"step_ratio {c} / {a}"] = [round(x["step_s"] / y["step_s"], 3) for x, y in zip(by[c], by[a])]
        for a, c in _comparisons(default):
            if a in by and c in by and min(len(by[a]), len(by[c])) > 1:  # (a test needs two seeds)
                t = compare([x["val_loss"] for x in by[a]], [x["val_loss"] for x in by[c]],
                            [x["seed"] for x in by[a]], [x["seed"] for x in by[c]])
                tests.append((kind, a, c, t))
        out["bases"][kind] = b
    adj = holm([t.p for *_, t in tests]) if tests else []
    out["tests"] = [{"base": k, "a": a, "b": c, "test": t.label, "diff": t.diff, "se": t.se, "p": t.p, "p_holm": p,
                     "finding": p < 0.05, "text": describe(t, p)} for (k, a, c, t), p in zip(tests, adj)]
    print(f"\nval loss after {args.steps} steps (mean ± sd over seeds) and median step time (s), per side; "
          f"the default init is {default_init():g}, chosen by {INIT_CHOSEN_BY}:")
    print("| side | " + " | ".join(f"{k} val loss | {k} step (s)" for k in bases) + " |")
    print("|---|" + "---|---|" * len(bases))
    for s in sides:
        cells = []
        for k in bases:
            v, st = out["bases"][k]["val_loss"][s], out["bases"][k]["step_s"][s]
            cells.append(f"{v['mean']:.4f} ± {v['std']:.4f} (n={v['n']}) | {min(st):.3f}-{max(st):.3f}")
        print(f"| {s}{' (default)' if s == default else ''} | " + " | ".join(cells) + " |")
    for k in bases:
        for key, v in out["bases"][k].items():
            if key.startswith("step_ratio"):
                print(f"{k}: {key.split(' ', 1)[1]}: {min(v):.2f}-{max(v):.2f}x")
    print("\nval loss, b - a (paired t by seed, Holm over the comparisons of both bases):")
    for t in out["tests"]:
        print(f"  {t['base']}: {t['b']} - {t['a']}: {t['text']}")
    for x in runs:
        if x.get("save_model_error"):
            print(f"  {x['base']} {x['side']} seed {x['seed']}: trainer.save_model's folder did not load back "
                  f"({x['save_model_error'][:160]}); round trip measured on the model's own save")
    print("exact at attach (max |dlogit|), adapter bytes, round trip max |dlogit|, peak RSS MiB:")
    for k in bases:
        b = out["bases"][k]
        for s in sides:
            print(f"  {k} {s}: {b['exact_at_attach'][s]:.2g}, {b['adapter_bytes'][s]:,}, "
                  f"{b['roundtrip_max_diff'][s]:.2g}, {b['peak_rss_mib'][s]:.0f}")
    return out


if __name__ == "__main__":
    main()
