"""`engram results`: docs/results.md and its plots, regenerated from the per-seed files in docs/results/.

How an experiment writes its record, and the record's table and plot, are `records.py`.

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

import re
from pathlib import Path

from ..persist import atomic_write_bytes
from . import significance as sig
from .records import OWN_REPORT, fmt_env, fmt_stat, own_report, plot, table_markdown
from .runs import read_result


def fmt_diff(test: sig.TestResult, p_holm: float) -> str:
    """One comparison of a family: difference ± se, the test, p, Holm-adjusted p, the verdict."""
    return sig.describe(test, p_holm)


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
                own_report(name).plot(rec, Path(img) / f"{name}.png")
    print(f"wrote {out} from {len(recs)} per-seed files" + (f" and their plots in {img}/" if img else ""))
    return 0
