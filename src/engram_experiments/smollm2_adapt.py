"""`engram experiment smollm2-adapt`: a real pretrained model given a memory. SmolLM2-135M-Instruct (fetched as a
GGUF file and imported, `integrations/gguf_bases.py`) adapted to the corpus it predicts worst: Engram adapter vs
LoRA vs full fine-tuning on the same tokens.

Every choice is read from the preregistration `docs/prereg/smollm2-adapt.toml` (`analysis/prereg.py`): the
candidate corpora and the rules that pick the domain, the general set and the shared-n-gram set from the base's
own losses (computed first and reported); the training budget; each method's learning-rate grid; the selection
seed (grids extended past an end that holds its best domain loss); the test seeds, the pairs, the metrics and
the test (paired t by seed, Holm over the family). `--record` refuses without a committed preregistration and a
clean tree, and the record stores the prereg's blob id and the commit that ran.

The methods (`METHODS` maps the prereg's names to `training.adapt.adapt` arguments):
* `engram`: the adapter's default sizes at the preregistered block, base frozen;
* `engram-matched`: the adapter at half the default width (`n_embed_per_ngram` 128 against SmolLM2's default 256,
  as retrofit's matched adapter) with rows per head solved so its trainable count equals lora-all's;
* `lora-all`: PEFT LoRA rank 8 on every linear layer;
* `full`: every weight of the base.

Forgetting is val loss after minus before, on the general set (the candidate the base predicts best) and on the
shared set (windows of the other candidates' val splits richest in the domain's 2-/3-grams: where the rows an
adapter trained fire). Each run trains in its own process (its own peak RSS), `--jobs` at once.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch

from engram.persist import write_json
from engram.training.checkpoint import checkpoints
from engram.training.run import read_run_file

from . import prereg
from .records import fmt_pm
from .registry import Experiment, register
from .retrofit import (
    LORA_ALL,
    eval_shared,
    extend_grid,
    lora_trainable,
    matched_engram,
    say,
    shared_windows,
    step_ms,
)
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

NAME = "smollm2-adapt"
METHODS = {"full": dict(method="full"), "lora-all": LORA_ALL, "engram": dict(method="engram"),
           "engram-matched": dict(method="engram", engram_options={"n_embed_per_ngram": 128, "n_head_per_ngram": 4})}


def smollm2_base(root: Path, name: str, progress: bool = True, label: str = NAME) -> Path:
    """The imported base folder in `root/base` (fetched and imported the first time; reruns reuse it); `label`
    names the experiment in the progress line."""
    from engram.integrations import gguf_bases

    folder = root / "base"
    if not (folder / "config.json").is_file():
        say(progress, f"[{label}] fetching and importing {name} -> {folder}")
        gguf_bases.import_gguf(gguf_bases.fetch(name, quiet=not progress), folder, overwrite=folder.exists())
    return folder


def method_args(base: Path, methods, layers: list[int], table: dict | None = None) -> dict[str, dict]:
    """{method: `training.adapt.adapt` arguments} on `base`, each named in `table` (default `METHODS`): the Engram
    methods (engram, lora+engram) at `layers`; engram-matched's rows solved so its trainable count equals lora-all's
    (`retrofit.matched_engram`)."""
    out = {}
    for m in methods:
        kw = {**(table or METHODS)[m]}
        if "engram" in kw["method"]:
            kw["layers"] = list(layers)
        if m == "engram-matched":
            kw["engram_options"] = matched_engram(base, lora_trainable(base), kw["engram_options"], layers)
        out[m] = kw
    return out


def choose_sets(losses: dict[str, float], design: dict) -> dict:
    """{domain, general, pool}: the candidates the preregistered rules pick from the base's losses (highest loss ->
    domain, lowest -> general, the rest -> the pool the shared set is drawn from)."""
    if design["domain_rule"] != "highest base val loss among candidates" or \
            design["general_rule"] != "lowest base val loss among candidates":
        raise ExperimentError(f"docs/prereg/{NAME}.toml: unknown domain/general rule; this code applies "
                              "'highest/lowest base val loss among candidates'")
    ranked = sorted(losses, key=losses.get)
    return {"domain": ranked[-1], "general": ranked[0], "pool": [c for c in design["candidates"]
                                                                  if c not in (ranked[0], ranked[-1])]}


def tests_of(chosen: dict[str, dict], pairs, metrics) -> list[dict]:
    """b - a for each preregistered pair and metric over the test seeds (paired t), Holm over the whole family."""
    from .significance import compare, holm, is_finding

    out = []
    for a, b in pairs:
        for k in metrics:
            ca, cb = chosen[a], chosen[b]
            t = compare(ca[k]["values"], cb[k]["values"], ca["seeds"], cb["seeds"])
            out.append({"a": f"{a} lr {ca['lr']:g}", "b": f"{b} lr {cb['lr']:g}", "metric": k, "kind": t.kind,
                        "diff": t.diff, "se": t.se, "df": t.df, "p": t.p, "n": t.n_a, "min_detectable": detectable(t)})
    for t, adj in zip(out, holm([t["p"] for t in out])):
        t["p_holm"], t["finding"] = adj, is_finding(adj)
    return out


def run(out: str | Path = "runs/experiments", progress: bool = True, record: str | Path | None = None,
        jobs: int = 1, max_steps: int | None = None, repo: Path | None = None) -> dict:
    """The preregistered design (resumable: one folder per run, finished runs skipped), then summary.json/.md and
    plot.png in OUT/smollm2-adapt; `record`: also `record/smollm2-adapt.json`. `max_steps` overrides the
    prereg's budget for a trial (then nothing can be recorded)."""
    from engram.inference import load_base
    from engram.training.adapt import evaluate_on
    from engram.training.config import TrainConfig
    from engram.training.train import evaluate
    from engram.utils import environment

    if record is not None and max_steps is not None:
        raise ExperimentError("--max-steps departs from the preregistered budget; drop it to --record")
    pre = prereg.load(NAME, record=record is not None, repo=repo)
    d = pre.design
    tr, sel, test = d["train"], d["selection"], d["test"]
    root = Path(out) / NAME
    root.mkdir(parents=True, exist_ok=True)
    base = smollm2_base(root, d["base"], progress)
    settings = {k: tr[k] for k in ("seq_len", "batch_size", "warmup_steps", "weight_decay", "eval_max_windows")}
    tcfg = TrainConfig(**{**TrainConfig().to_dict(), **settings, "tokenizer": str((base / "tokenizer.json").resolve())})
    steps = max_steps or tr["steps"]

    # 1. the base's loss on every candidate, then the sets the rules pick
    before_file = root / "base_eval.json"
    if not before_file.is_file():
        say(progress, f"[{NAME}] the base's val loss on {', '.join(d['candidates'])}")
        model, _ = load_base(base)
        write_json(before_file, {c: evaluate_on(model.eval(), [c], tcfg) for c in d["candidates"]}, indent=None)
    losses = read_result(before_file, "base evaluation")
    sets = choose_sets(losses, d)
    domain, general = [sets["domain"]], [sets["general"]]
    shared, shared_info = shared_windows(tcfg.tokenizer, domain, sets["pool"], tcfg.seq_len, d["shared_windows"])
    shared_file = root / "base_shared.json"
    if not shared_file.is_file():
        model, _ = load_base(base)
        write_json(shared_file, {"shared": evaluate(model.eval(), shared, tcfg.batch_size, torch.device("cpu"))})
    before = {"domain": losses[sets["domain"]], "general": losses[sets["general"]],
              "shared": read_result(shared_file, "base evaluation")["shared"]}
    say(progress, f"[{NAME}] domain {sets['domain']} ({before['domain']:.4f}), general {sets['general']} "
                   f"({before['general']:.4f}), shared set {before['shared']:.4f} from {' + '.join(sets['pool'])}")

    # 2. the methods: adapt() arguments; engram-matched's rows solved on this base for lora-all's count
    args = method_args(base, d["methods"], tr["layers"])
    methods = {m: (args[m], sorted(lrs)) for m, lrs in d["methods"].items()}

    def dir_of(m: str, lr: float, seed: int) -> Path:
        return root / f"{m}-lr{lr:g}-seed{seed}"

    def train_one(key: tuple[str, float, int]) -> None:
        m, lr, seed = key
        run_dir = dir_of(m, lr, seed)
        if (run_dir / "summary.json").is_file():
            return
        say(progress, f"[{NAME}] {m} lr {lr:g} seed {seed} -> {run_dir}")
        kw = dict(base=str(base), data=domain, out=str(run_dir), max_steps=steps,
                  overrides={**settings, "lr": lr, "seed": seed, "ckpt_every": steps, "eval_every": steps},
                  resume=bool(checkpoints(run_dir)), progress=False, extra_eval={"general": general}, **methods[m][0])
        call_in_subprocess("engram.training.adapt:adapt", kw, root / f"runs-{run_dir.name}.log",
                           f"{NAME} run {run_dir}", jobs)

    def result(m: str, lr: float, seed: int) -> dict:
        run_dir = dir_of(m, lr, seed)
        s = read_run_file(run_dir, "summary.json")
        shared_val = eval_shared(base, run_dir, methods[m][0]["method"], shared, tcfg.batch_size)
        return {"method": m, "lr": lr, "seed": seed, "domain_val": s["val_loss"],
                "forgetting_general": s["extra_eval"]["general"] - before["general"],
                "forgetting_shared": shared_val - before["shared"],
                "step_ms": step_ms(run_dir, tcfg.seq_len * tcfg.batch_size), "peak_rss_mib": s["peak_rss_mib"],
                "trainable": s["trainable"], "environment": s.get("environment")}

    # 3. the selection seed: each grid, extended while its best domain loss sits at an end
    s0 = sel["seed"]
    grids = {m: lrs for m, (_, lrs) in methods.items()}
    extended: dict[str, dict] = {m: {} for m in methods}
    runs: list[dict] = []
    pending = list(methods)
    while pending:
        run_parallel(train_one, [(m, lr, s0) for m in pending for lr in grids[m]], jobs)
        runs += [result(m, lr, s0) for m in pending for lr in grids[m]
                 if not any(r["method"] == m and r["lr"] == lr for r in runs)]
        nxt = {m: extend_grid(grids[m], {r["lr"]: r["domain_val"] for r in runs if r["method"] == m}, extended[m],
                              limit=sel["extend"]) for m in pending}
        pending = [m for m in pending if nxt[m] is not None]
        for m in pending:
            grids[m] = sorted(grids[m] + [nxt[m]])
    chosen_lr = {m: min((r for r in runs if r["method"] == m), key=lambda r: r["domain_val"])["lr"] for m in methods}

    # 4. the test seeds at each method's chosen lr, then the family of tests
    seeds = list(test["seeds"])
    run_parallel(train_one, [(m, chosen_lr[m], s) for s in seeds for m in methods], jobs)
    runs += [result(m, chosen_lr[m], s) for s in seeds for m in methods]
    chosen = {}
    for m in methods:
        rs = sorted((r for r in runs if r["method"] == m and r["seed"] in seeds), key=lambda r: r["seed"])
        chosen[m] = {"lr": chosen_lr[m], "seeds": [r["seed"] for r in rs],
                     "interior": min(grids[m]) < chosen_lr[m] < max(grids[m]), "trainable": rs[0]["trainable"],
                     **{k: seed_stats([r[k] for r in rs]) for k in
                        ("domain_val", "forgetting_general", "forgetting_shared", "step_ms", "peak_rss_mib")}}
    tests = tests_of(chosen, test["pairs"], test["metrics"])
    summary = {"experiment": NAME, "date": datetime.date.today().isoformat(),
               "command": f"engram experiment {NAME} --jobs {jobs} --record docs/results",
               "prereg": pre.stamp(), "design": d, "adapt_steps": steps,
               "tokens_per_step": tcfg.seq_len * tcfg.batch_size, "base_losses": losses, "sets": sets,
               "before": before, "shared_set": shared_info,
               "methods": {m: kw | {"lrs": grids[m], "extended": extended[m]} for m, (kw, _) in methods.items()},
               "chosen": chosen, "tests": tests, "runs": runs, "peak_rss_measure": "VmHWM"}
    summary["environments"] = index_environments(runs) or [environment()]
    return publish(summary, root, record, f"{NAME}.json", markdown, plot)


def _fmt(s: dict, sign: bool = False) -> str:
    return fmt_pm(s["mean"], s["std"], sign=sign)


METRIC = {"domain_val": "domain loss", "forgetting_general": "forgetting (general)",
          "forgetting_shared": "forgetting (shared n-grams)"}


def dominated_by(points: list[dict], keys=tuple(METRIC)) -> list[list[int]]:
    """For each point, the indices of the points that dominate it: at least as low on every key of `keys` (domain
    loss and forgetting on both sets; lower is better) and lower on one. Empty: the point is on the front."""
    def beats(q: dict, p: dict) -> bool:
        return all(q[k] <= p[k] for k in keys) and any(q[k] < p[k] for k in keys)
    return [[j for j, q in enumerate(points) if j != i and beats(q, p)] for i, p in enumerate(points)]


def selection_markdown(s: dict) -> list[str]:
    """The selection seed's runs, every (method, lr) point with its three measures, the dominated ones marked and
    named with the undominated points that beat them; the lr each method selected (its lowest domain loss) in bold."""
    sel = s["design"]["selection"]["seed"]
    pts = [r for m in s["methods"] for r in sorted((r for r in s["runs"] if r["method"] == m and r["seed"] == sel),
                                                   key=lambda r: r["lr"])]
    by = dominated_by(pts)
    front = [i for i, d in enumerate(by) if not d]

    def name(r: dict) -> str:
        return f"{r['method']} {r['lr']:g}"

    lines = [f"Selection seed {sel}, every learning rate of each grid (one run each; lower is better on all three "
             f"measures; the selected lr, each method's lowest domain loss, in bold). † marks a dominated point: "
             f"another point, of any method, is at least as low on all three measures and lower on at least one; "
             f"the last column names the undominated points that dominate it:", "",
             "| method | lr | domain val loss | forgetting (general) | forgetting (shared n-grams) | dominated by |",
             "|---|---|---|---|---|---|"]
    for r, d in zip(pts, by):
        lr = f"{r['lr']:g}"
        if s["chosen"].get(r["method"], {}).get("lr") == r["lr"]:
            lr = f"**{lr}**"
        who = ", ".join(name(pts[j]) for j in d if not by[j])
        lines.append(f"| {r['method']}{' †' if d else ''} | {lr} | {r['domain_val']:.4f} | "
                     f"{r['forgetting_general']:+.4f} | {r['forgetting_shared']:+.4f} | {who} |")
    beaten = [m for m in s["methods"] if not any(pts[i]["method"] == m for i in front)]
    lines += ["", f"Undominated on the selection seed: {', '.join(name(pts[i]) for i in front)}"
              + (f"; every point of {' and '.join(beaten)} is dominated." if beaten else ".")]
    return lines


def markdown(s: dict) -> str:
    """The base's losses, the selection grid (its three measures, the dominated points marked), the chosen points over
    the test seeds, the tests and the cost."""
    from .significance import fmt_p

    b, sets, sh = s["before"], s["sets"], s["shared_set"]
    rss = s.get("peak_rss_measure") == "VmHWM"  # records before it measured each run's own peak: not shown
    n = len(s["design"]["test"]["seeds"])
    lines = [f"Preregistration `{s['prereg']['file']}` (blob {str(s['prereg']['blob'])[:10]}, "
             f"{s['prereg']['status']}; run at commit {str(s['prereg']['commit'])[:10]}).", "",
             "The base's val loss on each candidate corpus (the rules pick the domain and the general set):", "",
             "| corpus | base val loss | role |", "|---|---|---|"]
    for c, v in s["base_losses"].items():
        role = "domain" if c == sets["domain"] else "general" if c == sets["general"] else "shared-set pool"
        lines.append(f"| {c} | {v:.4f} | {role} |")
    lines += ["", f"Shared set: {sh['windows']} of the pool's {sh['of']} val windows, {sh['ngram_share']:.0%} of "
                  f"their token 2-/3-grams in the domain's train split (base loss {b['shared']:.4f}). "
                  f"{s['adapt_steps']} steps x {s['tokens_per_step']:,} tokens per run.", "",
              *selection_markdown(s)]
    seeds = ", ".join(map(str, s["design"]["test"]["seeds"]))
    lines += ["", f"Each method at its selected learning rate, test seeds {seeds} (mean ± sd, n={n}):", "",
              "| method | lr | domain val loss | forgetting (general) | forgetting (shared) | trainable | step (ms) |"
              + (" peak RSS (MiB) |" if rss else ""), "|---|---|---|---|---|---|---|" + ("---|" if rss else "")]
    for m, c in s["chosen"].items():
        edge = "" if c["interior"] else " (edge)"
        lines.append(f"| {m} | {c['lr']:g}{edge} | {_fmt(c['domain_val'])} | {_fmt(c['forgetting_general'], True)} | "
                     f"{_fmt(c['forgetting_shared'], True)} | {c['trainable']['trainable']:,} | "
                     f"{c['step_ms']['mean']:.0f} ± {c['step_ms']['std']:.0f} |"
                     + (f" {c['peak_rss_mib']['mean']:.0f} |" if rss else ""))
    if not rss:
        top = max(r["peak_rss_mib"] for r in s["runs"])
        lines += ["", f"Peak RSS is not shown: these runs measured it with `ru_maxrss`, which Linux carries across "
                      f"fork and exec, so each run reported at least its driver's peak ({top:,.0f} MiB for every "
                      "test-seed run); `utils.peak_rss_mib` now reads the process's own high-water mark (VmHWM)."]
    lines += ["", "Step times are medians over each run's steps after the fifth, two runs at a time (`--jobs 2`, one "
                  "thread each) on a machine also running other work: a rough cost, not a benchmark."]
    lines += ["", f"Tests (preregistered family of {len(s['tests'])}: B - A, paired t over the test seeds, "
                  "Holm-adjusted; a finding when Holm p < 0.05, otherwise the difference the test could have "
                  "detected at 80% power):",
              "", "| A | B | metric | B - A | p | Holm p | verdict |", "|---|---|---|---|---|---|---|"]
    for t in s["tests"]:
        lines.append(f"| {t['a']} | {t['b']} | {METRIC[t['metric']]} | {fmt_pm(t['diff'], t['se'], sign=True)} | "
                     f"{fmt_p(t['p'])} | {fmt_p(t['p_holm'])} | {verdict(t)} |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """Domain loss vs forgetting on the general and the shared set: every test-seed run, each method's mean."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    from .retrofit import COLORS

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    seeds = set(s["design"]["test"]["seeds"])
    for ax, key in ((axes[0], "forgetting_general"), (axes[1], "forgetting_shared")):
        for m, c in s["chosen"].items():
            rs = [r for r in s["runs"] if r["method"] == m and r["seed"] in seeds and r["lr"] == c["lr"]]
            ax.scatter([r[key] for r in rs], [r["domain_val"] for r in rs], s=10, color=COLORS.get(m), alpha=0.4)
            ax.errorbar(c[key]["mean"], c["domain_val"]["mean"], xerr=c[key]["std"], yerr=c["domain_val"]["std"],
                        fmt="o", color=COLORS.get(m), capsize=3, label=f"{m} lr {c['lr']:g}")
        ax.set_xlabel(f"{METRIC[key]}: val loss after - before")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"domain ({s['sets']['domain']}) val loss")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"engram experiment {NAME}: SmolLM2-135M-Instruct, test seeds (mean ± sd, dots: each seed)")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


register(Experiment("smollm2-adapt", """
    SmolLM2-135M-Instruct (a real pretrained model, imported from its GGUF file) adapted to the
    corpus it predicts worst: Engram adapters vs LoRA vs full fine-tuning; every choice read from the
    committed preregistration docs/prereg/smollm2-adapt.toml (`--seeds` does not apply; --record
    refuses a dirty tree) (`smollm2_adapt.py`; --jobs 2: about 70 min on 2 cores).""",
                    run=lambda o: run(o.out, progress=o.progress, record=o.record, jobs=o.jobs, max_steps=o.max_steps),
                    table=markdown, plot=plot, plot_file="smollm2-adapt.png", section="12"))
