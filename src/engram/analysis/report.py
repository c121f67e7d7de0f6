"""`engram results`: docs/results.md and its plots, regenerated from the per-seed files in docs/results/.

Over 450 lines on purpose: the results page's one renderer and its number guard, kept together.

`engram experiment NAME --record docs/results` writes `docs/results/NAME.json`: every variant's final val
loss for every seed, the seeds, parameter counts, the val curves (iso), and the environment each run
recorded (library versions, threads, CPU, ENGRAM_FUSED, commit). `docs/results.in.md` is the text of
the results page; `render` fills its placeholders from those files, so every number in a table, a test or a
"finding" comes from the committed per-seed values:

    {{table:EXP}}           the experiment's table: mean ± sample sd (n) and the difference of means to its baseline
    {{stat:EXP/VARIANT}}    "4.6593 ± 0.0118 (n=3)"; EXP/VARIANT#FIELD for a nested one (sensitivity's #increase)
    {{family:LABEL          a section's family of comparisons, one `EXP/A:EXP/B` (B - A) per line: tested by
    EXP/A:EXP/B ...}}       `significance.compare` (paired on shared seeds, Welch otherwise), Holm-adjusted within
                            the family, rendered as a table with p, Holm p and the verdict
    {{diff:EXP/A:EXP/B}}    one comparison of a family declared in the same section: "+0.0253 ± 0.0081 (paired t,
                            n=3; p 0.012, Holm 0.048): a finding" or "...: not a finding (detectable at 80%
                            power: ±0.031)"
    {{welch:EXP/A:EXP/B}}   the same b - a by Welch's unpaired test, unadjusted and outside every family: a check
                            where pairs are weaker than the rule assumes (seeds run on different machines)
    {{value:EXP/KEY.KEY}}   one number of a record (a single measurement: gates, stats), formatted by the
                            Python format spec after `|` (`{{value:gates/mean_gate.entity|.3f}}`)
    {{quoted:SOURCE|TEXT}}  a number that is not ours (the paper's, an earlier session's): "TEXT (quoted: SOURCE)"
    {{set:TEXT}}            a setting or a description of the setup written in prose (an init std, a rho, a
                            corpus size, the test's alpha), rendered as TEXT
    {{env:EXP}}             the environment the experiment's runs recorded

`unsourced_numbers` lists what looks like a measured number (decimals, percentages, ±, "Nx") outside those
placeholders and code spans; the tests require it to find none. `main` (the CLI) writes docs/results.md and
the plots docs/img/exp-EXP.png; `--check` only compares.
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path

from ..persist import atomic_write_bytes, write_json
from . import significance as sig
from .runs import ExperimentError, read_result

# the row every other row of an experiment's table is compared with
BASELINE = {"iso": "no-engram", "placement": "block1", "capacity": "no-engram", "ablations": "full",
            "design": "reference", "allocation": "moe-E16", "allocation-sweep": "moe-E16"}


# experiments whose module renders its own table and plot (`markdown(rec)`, `plot(rec, path)`) from the record
OWN_REPORT = {"edit": "editing", "retrofit": "retrofit", "smollm2-adapt": "smollm2"}


def _own_report(name: str):
    from importlib import import_module

    return import_module(f".{OWN_REPORT[name]}", __package__)


# ------------------------------------------------------------------------------------------ recording
def experiment_record(summary: dict, results: dict[str, list[dict]], command: str | None = None) -> dict:
    """What `--record` commits: the summary's table (per-seed values included), each variant's seeds, the val
    curves of `iso`, and the environments the runs recorded (deduplicated; `run_environment` indexes them)."""
    name = summary["experiment"]
    rec = {"experiment": name, "preset": summary["preset"], "date": datetime.date.today().isoformat(),
           "command": command or f"engram experiment {name} --seeds {summary['seeds']} --record docs/results",
           "variants": summary["variants"], "seeds": {v: [r["seed"] for r in rs] for v, rs in results.items()}}
    steps = sorted({r["step"] for rs in results.values() for r in rs if "step" in r})  # what the runs trained
    if steps:
        rec["steps"] = steps
    envs: list[dict] = []
    rec["run_environment"] = {}
    for v, rs in results.items():
        for r in rs:
            env = r.get("environment")
            if env is None:
                continue
            if env not in envs:
                envs.append(env)
            rec["run_environment"][f"{v}/seed{r['seed']}"] = envs.index(env)
    rec["environments"] = envs
    if name == "iso":
        rec["curves"] = {v: [[[m["step"], m["val_loss"]] for m in r["metrics"] if "val_loss" in m] for r in rs]
                         for v, rs in results.items()}
    return rec


def recorded_runs(path: Path) -> dict[str, list[dict]]:
    """The runs an existing record `path` holds, as `{variant: [{"seed", "val_loss", "environment",
    "recorded": True}]}` (`{}` when there is none): a sweep that adds seeds to a committed record trains only
    the (variant, seed) pairs it lacks and records the others as they were recorded, environments included."""
    path = Path(path)
    if not path.is_file():
        return {}
    rec = read_result(path, "experiment record")
    envs, where = rec.get("environments") or [], rec.get("run_environment") or {}
    out: dict[str, list[dict]] = {}
    for v, seeds in (rec.get("seeds") or {}).items():
        values = rec["variants"][v]["values"]
        if len(values) != len(seeds):
            raise ExperimentError(f"{path}: {v} has {len(values)} values for {len(seeds)} seeds; "
                                  f"delete the file and record the experiment again")
        out[v] = [{"seed": s, "val_loss": x, "recorded": True,
                   "environment": envs[where[f"{v}/seed{s}"]] if f"{v}/seed{s}" in where else None}
                  for s, x in zip(seeds, values)]
    return out


def record_experiment(path: Path, summary: dict, results: dict[str, list[dict]], command: str | None = None) -> dict:
    rec = experiment_record(summary, results, command)
    write_json(path, rec)
    return rec


# ------------------------------------------------------------------------------------------ formatting
def fmt_stat(s: dict) -> str:
    return f"{s['mean']:.4f} ± {s['std']:.4f} (n={s['n']})"


def fmt_diff(test: sig.TestResult, p_holm: float) -> str:
    """One comparison of a family: difference ± se, the test, p, Holm-adjusted p, the verdict."""
    return sig.describe(test, p_holm)


def fmt_env(rec: dict) -> str:
    envs = rec.get("environments") or ([rec["environment"]] if rec.get("environment") else [])
    if not envs:
        return "environment not recorded"
    parts = []
    for e in envs:
        libs = ", ".join(f"{k} {e[k]}" for k in ("torch", "numba", "transformers", "tokenizers") if e.get(k))
        commit = (e.get("commit") or "?")[:7]
        threads = f"{e.get('threads')} thread{'' if e.get('threads') == 1 else 's'}"
        parts.append(f"{libs}, {threads}, {e.get('cpu')}, ENGRAM_FUSED={e.get('ENGRAM_FUSED')}, code at {commit}")
    return "; ".join(parts) if len(parts) == 1 else f"{len(parts)} environments: " + "; ".join(parts)


def table_markdown(rec: dict, name: str | None = None) -> str:
    """The table of record `rec` (`name`: its file's stem, for records without an "experiment" key)."""
    name = rec.get("experiment", name)
    if name == "allocation-accounting":  # `experiment allocation --plan-only --record`: the accounting table
        return accounting_markdown(rec["variants"]).rstrip("\n")
    if name == "stats":  # `engram stats --record`: row usage and collisions per order and table size
        return stats_markdown(rec)
    if name in OWN_REPORT:  # edit: methods x metrics over fact sets; retrofit: the sweep and chosen points
        return _own_report(name).markdown(rec).rstrip("\n")
    table = rec["variants"]
    if name == "sensitivity":
        lines = ["| token category | tokens | loss with Engram | Engram suppressed | increase (mean ± sd, n) |",
                 "|---|---|---|---|---|"]
        for cat, r in table.items():
            lines.append(f"| {cat} | {r['tokens']:,} | {r['on']['mean']:.3f} | {r['off']['mean']:.3f} | "
                         f"{r['increase']['mean']:+.3f} ± {r['increase']['std']:.3f} (n={r['increase']['n']}) |")
        return "\n".join(lines)
    if rec.get("quoted"):  # summary statistics kept from runs whose per-seed values were not (allocation-sweep)
        lines = ["| variant | rho | seeds | final val loss (mean ± half-range) | sd used by the tests | vs "
                 f"{BASELINE.get(name, '-')} |", "|---|---|---|---|---|---|"]
        base = table.get(BASELINE.get(name, ""))
        for v, r in table.items():
            rho = f"{100 * r['rho']:.1f}%" if r.get("rho") is not None else "-"
            vs = f"{r['mean'] - base['mean']:+.4f}" if base else ""
            lines.append(f"| {v} | {rho} | {r['n']} | {r['mean']:.4f} ± {r['half_range']:.4f} | {r['std']:.4f} | "
                         f"{vs} |")
        return "\n".join(lines)
    base = BASELINE.get(name)
    lines = [f"| variant | final val loss (mean ± sd, n) | vs {base} (difference of means) | params | table params |",
             "|---|---|---|---|---|"]
    for v, r in table.items():
        vs = "" if base is None or v == base or base not in table else f"{r['mean'] - table[base]['mean']:+.4f}"
        lines.append(f"| {v} | {fmt_stat(r)} | {vs} | {r['params']:,} | {r['table_params']:,} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ rendering
def accounting_markdown(vs: list[dict]) -> str:
    """The allocation sweep's accounting table from its variants (`allocation.Variant` as dicts: what
    `experiment allocation --plan-only --record` writes to allocation-accounting.json)."""
    lines = ["| variant | rho (MoE share) | routed experts | shared expert / FFN width | total params | activated "
             "(embedding + LM head share) | table params | FLOPs/token (fwd, no hashing or gather) | tokens per row |",
             "|---|---|---|---|---|---|---|---|---|"]
    for v in vs:
        a = v["accounting"]
        E = v["model_overrides"].get("n_routed_experts", "-") if v["kind"] != "dense" else "-"
        rho = f"{100 * v['rho']:.1f}%" if v["rho"] is not None else "-"
        fl = f"{a['flops_per_token'] / 1e6:.3f}M" if "flops_per_token" in a else "-"
        tpr = f"{a['tokens_per_row']:,.0f}" if a.get("tokens_per_row") else "-"
        share = f" ({a['embedding_share_of_activated']:.0%})" if "embedding_share_of_activated" in a else ""
        lines.append(f"| {v['name']} | {rho} | {E} | {a.get('ffn_width', '-')} | {a['total']:,} | "
                     f"{a['activated']:,}{share} | {a['table']:,} | {fl} | {tpr} |")
    return "\n".join(lines) + "\n"


def stats_markdown(rec: dict) -> str:
    """`engram stats --record`'s row usage: one head per order, per table size."""
    lines = ["| order | rows | distinct n-grams | rows used | usage | n-grams sharing their row with another |",
             "|---|---|---|---|---|---|"]
    for u in rec["row_usage"]:
        lines.append(f"| {u['order']} | {u['table_rows']:,} | {u['distinct_ngrams']:,} | {u['rows_used']:,} | "
                     f"{u['row_usage']:.1%} | {u['collision_rate']:.1%} |")
    return "\n".join(lines)


def load(results_dir: str | Path) -> dict[str, dict]:
    out = {}
    for f in sorted(Path(results_dir).glob("*.json")):
        rec = read_result(f, "experiment record")
        out[rec.get("experiment", f.stem)] = rec
    return out


def _stat(recs: dict, ref: str) -> dict:
    """`EXP/VARIANT` (or `EXP/VARIANT#FIELD` for a nested statistic, e.g. sensitivity's `#increase`)."""
    exp, _, variant = ref.partition("/")
    variant, _, sub = variant.partition("#")
    try:
        return recs[exp]["variants"][variant][sub] if sub else recs[exp]["variants"][variant]
    except KeyError:
        raise KeyError(f"{ref!r}: no such experiment/variant in the per-seed files") from None


def _seeds(rec: dict, variant: str) -> list[int] | None:
    """The seeds of `variant`'s values in their order: the record's per-variant list, its only list (one set of
    models measured several ways: sensitivity's categories), or range(n) for a record that kept only a count."""
    seeds = rec.get("seeds")
    if isinstance(seeds, dict):
        if variant in seeds:
            return list(seeds[variant])
        return list(next(iter(seeds.values()))) if len(seeds) == 1 else None
    return list(range(seeds)) if isinstance(seeds, int) else None


def comparison(recs: dict, a: str, b: str) -> sig.TestResult:
    """The test of b - a (`EXP/VARIANT[#FIELD]` references): `significance.compare` on the per-seed values,
    paired by seed where both have them; Welch from mean, sd and n for a record that kept only those."""
    sa, sb = _stat(recs, a), _stat(recs, b)
    if "values" in sa and "values" in sb:
        seeds = [_seeds(recs[r.partition("/")[0]], r.partition("/")[2].partition("#")[0]) for r in (a, b)]
        return sig.compare(sa["values"], sb["values"], *seeds)
    return sig.welch_summary(sa["mean"], sa["std"], sa["n"], sb["mean"], sb["std"], sb["n"])


def _short(ref: str, other: str) -> str:
    exp, _, variant = ref.partition("/")
    variant = variant.partition("#")[0]
    return variant if exp == other.partition("/")[0] else f"{exp}/{variant}"


def family(recs: dict, pairs: list[tuple[str, str]]) -> list[dict]:
    """Every comparison (a, b) of a family tested, with its Holm-adjusted p and verdict."""
    tests = [comparison(recs, a, b) for a, b in pairs]
    adjusted = sig.holm([t.p for t in tests])
    return [{"a": a, "b": b, "test": t, "p_holm": q, "finding": sig.is_finding(q)}
            for (a, b), t, q in zip(pairs, tests, adjusted)]


def family_markdown(label: str, rows: list[dict]) -> str:
    """The family's table: what each test compared, how, and what it found."""
    kinds = sorted({r["test"].kind for r in rows})
    how = " and ".join({"paired": "paired t-tests (shared seeds)", "welch": "Welch t-tests"}[k] for k in kinds)
    lines = [f"**Tests, family {label}** ({len(rows)} comparison{'s' if len(rows) > 1 else ''}, {how}, two-sided, "
             f"Holm-adjusted within the family; a finding: Holm p < {sig.ALPHA}; otherwise the smallest true "
             f"difference the test detects with {sig.POWER:.0%} power at alpha {sig.ALPHA}):",
             "", "| comparison (b - a) | difference ± se | test | p | Holm p | verdict |", "|---|---|---|---|---|---|"]
    for r in rows:
        t = r["test"]
        verdict = "**finding**" if r["finding"] else f"not a finding (detectable: ±{sig.min_detectable(t):.4f})"
        lines.append(f"| {_short(r['b'], r['a'])} - {_short(r['a'], r['b'])} | {t.diff:+.4f} ± {t.se:.4f} | "
                     f"{t.label} | {sig.fmt_p(t.p)} | {sig.fmt_p(r['p_holm'])} | {verdict} |")
    return "\n".join(lines)


def _value(recs: dict, arg: str) -> str:
    ref, _, spec = arg.partition("|")
    exp, _, path = ref.partition("/")
    x = recs.get(exp)
    for key in path.split("."):
        if isinstance(x, list) and key.isdigit() and int(key) < len(x):
            x = x[int(key)]
        elif isinstance(x, dict) and key in x:
            x = x[key]
        else:
            raise KeyError(f"{ref!r}: no such value in the per-seed files")
    return format(x, spec)


PLACEHOLDER = re.compile(r"\{\{(table|stat|diff|welch|env|family|value|quoted|set):([^}]+)\}\}")


def _families(section: str, recs: dict) -> dict[str, tuple[str, list[dict]]]:
    """label -> (label, tested rows) of every `{{family:...}}` the section declares."""
    out = {}
    for m in PLACEHOLDER.finditer(section):
        if m.group(1) == "family":
            label, *lines = [x.strip() for x in m.group(2).strip().splitlines()]
            pairs = [tuple(x.split(":")) for x in lines if x]
            if not pairs or any(len(p) != 2 for p in pairs):
                raise ValueError(f"family {label!r}: one EXP/A:EXP/B comparison per line after the label")
            out[label] = (label, family(recs, pairs))
    return out


def render(template: str, recs: dict[str, dict]) -> str:
    """Fill the template's placeholders section by section (a `{{diff}}` belongs to a family of its section)."""
    def rec(name: str) -> dict:
        if name not in recs:
            raise KeyError(f"no per-seed file for experiment {name!r} (engram experiment {name} --record DIR)")
        return recs[name]

    def section(text: str) -> str:
        fams = _families(text, recs)
        tested = {(r["a"], r["b"]): r for _, rows in fams.values() for r in rows}

        def fill(m: re.Match) -> str:
            kind, arg = m.group(1), m.group(2)
            if kind == "table":
                return table_markdown(rec(arg), arg)
            if kind == "stat":
                return fmt_stat(_stat(recs, arg))
            if kind == "diff":
                a, b = arg.split(":")
                if (a, b) not in tested:
                    raise KeyError(f"{{{{diff:{arg}}}}}: not in a family of its section; list {a}:{b} in the "
                                   f"section's {{{{family:...}}}}")
                r = tested[(a, b)]
                return fmt_diff(r["test"], r["p_holm"])
            if kind == "welch":
                a, b = arg.split(":")
                sa, sb = _stat(recs, a), _stat(recs, b)
                t = sig.welch(sa["values"], sb["values"])
                return (f"{t.diff:+.4f} ± {t.se:.4f} ({t.label}, unadjusted, outside the family; "
                        f"p {sig.fmt_p(t.p)})")
            if kind == "family":
                return family_markdown(*fams[arg.strip().splitlines()[0].strip()])
            if kind == "value":
                return _value(recs, arg)
            if kind == "quoted":
                source, _, text = arg.partition("|")
                if not source.strip() or not text.strip():
                    raise ValueError(f"{{{{quoted:{arg}}}}}: write {{{{quoted:SOURCE|TEXT}}}}")
                return f"{text} (quoted: {source.strip()})"
            if kind == "set":
                return arg
            if kind == "env":
                return fmt_env(rec(arg))
            raise ValueError(f"unknown placeholder {{{{{kind}:{arg}}}}}")

        return PLACEHOLDER.sub(fill, text)

    return "".join(section(part) for part in re.split(r"(?m)^(?=## )", template))


# what a measured number looks like in prose: a decimal, a percentage, ±, a multiple ("14x")
# (not a name's version: V4.1, Qwen2.5)
_MEASURED = re.compile(r"(?<![\w.])\d+\.\d|(?<![\w.])\d+(\.\d+)?%|±|(?<![\w.])\d+(\.\d+)?x\b")


def unsourced_numbers(template: str) -> list[tuple[int, str]]:
    """(line number, line) of every template line whose text outside placeholders, code spans and image/link
    targets still holds a measured-looking number (a decimal, a percentage, ±, "Nx"): each must come from a
    record (`{{stat}}`, `{{diff}}`, `{{table}}`, `{{value}}`) or be marked (`{{quoted}}`, `{{set}}`)."""
    text = PLACEHOLDER.sub(lambda m: "\0" * (m.group(0).count("\n")) + " ", template)  # keep line numbers
    text = text.replace("\0", "\n")
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if line.startswith("#"):
            continue
        bare = re.sub(r"`[^`]*`", " ", line)  # commands, file names, settings in code
        bare = re.sub(r"\]\([^)]*\)", "]", bare)  # link and image targets
        if _MEASURED.search(bare):
            out.append((i, line))
    return out


# ------------------------------------------------------------------------------------------ plots
def plot(rec: dict, path: str | Path) -> None:
    """The experiment's plot from its record (error bars: sample standard deviation over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    import numpy as np

    name, table = rec["experiment"], rec["variants"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if name == "iso" and rec.get("curves"):
        for v, curves in rec["curves"].items():
            steps = [s for s, _ in curves[0]]
            mean = np.mean([[x for _, x in c] for c in curves], axis=0)
            ax.plot(steps[1:], mean[1:], "o-", label=f"{v} (mean of {len(curves)} seeds)")
        ax.set_xlabel("step")
        ax.set_ylabel("val loss")
        ax.legend()
    elif name == "placement":
        xs = list(range(len(table)))
        ax.errorbar(xs, [table[v]["mean"] for v in table], yerr=[table[v]["std"] for v in table], fmt="o-", capsize=3)
        ax.set_xticks(xs, list(table))
        ax.set_xlabel("Engram block (0-based)")
        ax.set_ylabel("final val loss (± sd)")
    elif name == "capacity":
        pts = sorted((int(v[4:]), table[v]) for v in table if v.startswith("rows"))
        ax.errorbar([p for p, _ in pts], [t["mean"] for _, t in pts], yerr=[t["std"] for _, t in pts], fmt="o-",
                    capsize=3, label="Engram")
        if "no-engram" in table:
            t = table["no-engram"]
            ax.axhline(t["mean"], color="gray", ls="--", label="no Engram (± sd shaded)")
            ax.axhspan(t["mean"] - t["std"], t["mean"] + t["std"], color="gray", alpha=0.15)
        ax.set_xscale("log")
        ax.set_xlabel("rows per head")
        ax.set_ylabel("final val loss (± sd)")
        ax.legend()
    elif name == "sensitivity":
        cats = list(table)
        ax.bar(cats, [table[c]["increase"]["mean"] for c in cats], yerr=[table[c]["increase"]["std"] for c in cats],
               capsize=3)
        ax.set_ylabel("val loss increase when Engram is suppressed")
    else:
        vs = list(table)
        ax.barh(vs, [table[v]["mean"] for v in vs], xerr=[table[v]["std"] for v in vs], capsize=3)
        lo = min(table[v]["mean"] for v in vs)
        ax.set_xlim(lo - 0.1, max(table[v]["mean"] for v in vs) + 0.05)
        ax.set_xlabel("final val loss (± sd)")
    ax.grid(alpha=0.3)
    ax.set_title(f"engram experiment {name}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def main(results_dir: str, template: str, out: str, img: str = "", check: bool = False) -> int:
    """Write `out` (and the plots into `img`) from `template` and the per-seed files; `check`: exit 1 if stale."""
    recs = load(results_dir)
    tpath = Path(template)
    if not tpath.is_file():
        print(f"engram: no template {template}; run from the repository root or pass --template")
        return 1
    text = render(tpath.read_text(encoding="utf-8"), recs)
    if check:
        current = Path(out).read_text(encoding="utf-8") if Path(out).is_file() else ""
        if current != text:
            print(f"engram: {out} is not what {template} and {results_dir}/ give; run `engram results`")
            return 1
        print(f"{out} is up to date with {len(recs)} per-seed files")
        return 0
    atomic_write_bytes(Path(out), text.encode("utf-8"))
    if img:
        for name, rec in recs.items():
            if name in ("iso", "placement", "capacity", "ablations", "sensitivity", "allocation"):
                plot(rec, Path(img) / f"exp-{name}{'-4seeds' if name == 'allocation' else ''}.png")
            elif name in OWN_REPORT:
                _own_report(name).plot(rec, Path(img) / f"{name}.png")
    print(f"wrote {out} from {len(recs)} per-seed files" + (f" and their plots in {img}/" if img else ""))
    return 0
