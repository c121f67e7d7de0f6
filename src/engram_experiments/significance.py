"""The one home of the statistical test every results section uses, fixed before the numbers are read.

The rule (docs/results.md states it once):

- **The test.** Two variants that ran the same seeds (same init and data order) are compared with a
  **paired t-test** on the per-seed differences b - a, over the seeds both ran (`paired`); variants that
  share fewer than two seeds with a **Welch t-test** (`welch`). `compare` picks between them from the seeds.
  p-values are two-sided, from `scipy.stats` (t distribution).
- **The family.** Each section declares its family of comparisons; the p-values of a family are adjusted
  with **Holm's step-down method** (`holm`), which controls the family-wise error rate at `ALPHA`.
- **A finding** is a comparison whose Holm-adjusted p is below `ALPHA` = 0.05 (`is_finding`).
- **"No difference"** is never read from a large p alone. It comes with what the test could have seen:
  the **minimum detectable difference** (`min_detectable`): the true difference that the same test, at the
  observed sd and n, detects with `POWER` = 80% at two-sided alpha 0.05 (from the noncentral t
  distribution); and, where a margin is stated in advance, a **TOST equivalence test** (`equivalence`):
  both one-sided tests against +-margin, p = the larger of the two.

Everything here works on plain sequences of per-seed values, so the sections that render their own tables
(retrofit, editing) use the same functions as `report.py`. scipy is imported inside the functions
(`import engram` stays light; scipy comes with the `train` and `test` extras).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from engram.errors import EngramError

ALPHA = 0.05  # a finding: Holm-adjusted p below this
POWER = 0.80  # the power at which `min_detectable` states what a test could have seen


class SignificanceError(EngramError, ValueError):
    """A comparison cannot be tested as asked (too few values, mismatched pairs, a bad margin)."""


@dataclass(frozen=True)
class TestResult:
    """One two-sided t-test of b - a.

    kind: "paired" or "welch"; diff: mean(b - a) over the pairs (paired) or mean(b) - mean(a) (Welch);
    se: its standard error (sd of the differences / sqrt(n) paired; sqrt(sd_a²/n_a + sd_b²/n_b) Welch);
    df: degrees of freedom (n - 1 paired; Welch-Satterthwaite for Welch); t = diff / se; p: two-sided
    p-value; n_a, n_b: the values used per side (both the number of pairs for a paired test).
    """

    __test__ = False  # a result type, not a pytest test class (for test files that import it by name)

    kind: str
    diff: float
    se: float
    df: float
    t: float
    p: float
    n_a: int
    n_b: int

    @property
    def label(self) -> str:
        """"paired t, n=3" or "Welch t, n=4/2"."""
        return f"paired t, n={self.n_a}" if self.kind == "paired" else f"Welch t, n={self.n_a}/{self.n_b}"


def _two_sided_p(t: float, df: float) -> float:
    from scipy import stats

    return float(2 * stats.t.sf(abs(t), df))


def _t_and_p(diff: float, se: float, df: float) -> tuple[float, float]:
    if se > 0:
        t = diff / se
        return t, _two_sided_p(t, df)
    # no spread at all: an exact difference (p = 0) or none (p = 1); never seen with float losses
    return (math.copysign(math.inf, diff), 0.0) if diff != 0 else (0.0, 1.0)


def _values(xs: Sequence[float], what: str) -> list[float]:
    xs = [float(x) for x in xs]
    if len(xs) < 2:
        raise SignificanceError(f"{what}: {len(xs)} value(s); a t-test needs at least 2 per side (run more seeds)")
    if any(not math.isfinite(x) for x in xs):
        raise SignificanceError(f"{what}: a value is not finite ({xs}); fix the record that holds it")
    return xs


def paired(a: Sequence[float], b: Sequence[float]) -> TestResult:
    """Paired t-test of b - a: `a[i]` and `b[i]` come from the same seed. Needs >= 2 pairs."""
    if len(a) != len(b):
        raise SignificanceError(f"paired test: {len(a)} values against {len(b)}; pair them by seed first")
    d = _values([y - x for x, y in zip(a, b)], "paired test")
    n = len(d)
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    se = sd / math.sqrt(n)
    t, p = _t_and_p(mean, se, n - 1)
    return TestResult("paired", mean, se, n - 1, t, p, n, n)


def welch(a: Sequence[float], b: Sequence[float]) -> TestResult:
    """Welch's unequal-variance t-test of mean(b) - mean(a) (no shared seeds). Needs >= 2 values per side."""
    a, b = _values(a, "Welch test, first group"), _values(b, "Welch test, second group")
    return welch_summary(statistics.fmean(a), statistics.stdev(a), len(a), statistics.fmean(b), statistics.stdev(b),
                         len(b))


def welch_summary(mean_a: float, sd_a: float, n_a: int, mean_b: float, sd_b: float, n_b: int) -> TestResult:
    """`welch` from summary statistics (sample sds), for results that kept only mean, sd and n."""
    if n_a < 2 or n_b < 2:
        raise SignificanceError(f"Welch test: n = {n_a} and {n_b}; a t-test needs at least 2 per side (run more seeds)")
    va, vb = sd_a**2 / n_a, sd_b**2 / n_b
    se = math.sqrt(va + vb)
    # Welch-Satterthwaite degrees of freedom
    df = (va + vb) ** 2 / (va**2 / (n_a - 1) + vb**2 / (n_b - 1)) if se > 0 else float(n_a + n_b - 2)
    diff = mean_b - mean_a
    t, p = _t_and_p(diff, se, df)
    return TestResult("welch", diff, se, df, t, p, n_a, n_b)


def compare(a: Sequence[float], b: Sequence[float], seeds_a: Sequence[int] | None = None,
            seeds_b: Sequence[int] | None = None) -> TestResult:
    """b - a by the rule fixed above: paired on the seeds both ran when they share at least 2 (values of
    seeds only one side ran are left out of a paired test), Welch otherwise or when no seeds are given."""
    if seeds_a is not None and seeds_b is not None:
        if len(seeds_a) != len(a) or len(seeds_b) != len(b):
            raise SignificanceError(f"compare: {len(a)} values for {len(seeds_a)} seeds, {len(b)} for "
                                    f"{len(seeds_b)}; the record's seeds and values disagree")
        ia, ib = dict(zip(seeds_a, a)), dict(zip(seeds_b, b))
        shared = [s for s in seeds_a if s in ib]
        if len(shared) >= 2:
            return paired([ia[s] for s in shared], [ib[s] for s in shared])
    return welch(a, b)


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: sorted ascending, the i-th smallest (0-based)
    is multiplied by m - i, made non-decreasing, capped at 1. Controls the family-wise error rate."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adj = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * float(pvalues[i])))
        adj[i] = running
    return adj


def is_finding(p_adjusted: float, alpha: float = ALPHA) -> bool:
    """A finding: the Holm-adjusted p of a comparison in its section's family is below `alpha`."""
    return bool(p_adjusted < alpha)


def min_detectable(test: TestResult, power: float = POWER, alpha: float = ALPHA) -> float:
    """The smallest true |difference| that `test`'s design (its se and df, i.e. the observed sd and n) detects
    with probability `power` in a two-sided t-test at `alpha`: delta = nc x se, where nc solves
    P(|T'| > t_{1-alpha/2, df}) = power for T' noncentral t with df and noncentrality nc."""
    from scipy import optimize, stats

    if not 0 < alpha < 1 or not alpha < power < 1:
        raise SignificanceError(f"min_detectable: power {power} and alpha {alpha} need 0 < alpha < power < 1")
    crit = stats.t.ppf(1 - alpha / 2, test.df)

    def gap(nc: float) -> float:
        return _power(nc, test.df, crit) - power

    hi = 1.0
    while gap(hi) < 0:
        hi *= 2
    return float(optimize.brentq(gap, 0.0, hi, xtol=1e-10) * test.se)


def paired_power(effect: float, sd: float, n: int, alpha: float = ALPHA) -> float:
    """The power of a two-sided paired t-test at `alpha` with `n` pairs whose differences have true mean `effect`
    and sd `sd`: P(|T'| > t_{1-alpha/2, n-1}) for T' noncentral t with n - 1 df and noncentrality
    effect / (sd / sqrt(n)) (what `min_detectable` inverts)."""
    from scipy import stats

    if n < 2 or not sd > 0:
        raise SignificanceError(f"paired_power: n {n} and sd {sd}; a paired t-test needs n >= 2 and a positive sd")
    df = n - 1
    return _power(abs(effect) / (sd / math.sqrt(n)), df, stats.t.ppf(1 - alpha / 2, df))


def n_for_power(effect: float, sd: float, power: float = POWER, alpha: float = ALPHA, n_max: int = 1000) -> int:
    """The smallest number of pairs (>= 2) at which a two-sided paired t-test at `alpha` detects a true mean
    difference `effect` (sd of the differences `sd`) with probability `power` (`paired_power`): the n a
    replication needs to see the original's effect."""
    for n in range(2, n_max + 1):
        if paired_power(effect, sd, n, alpha) >= power:
            return n
    raise SignificanceError(f"n_for_power: more than {n_max} pairs for effect {effect} at sd {sd}")


def _power(nc: float, df: float, crit: float) -> float:
    """P(|T'| > crit) for T' noncentral t(df, nc): scipy's nct, or (where it returns nan: df = 1 at large nc) the
    same probability integrated over the chi-square of the denominator, T' = (Z + nc) / sqrt(V / df)."""
    from scipy import integrate, stats

    p = stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc)
    if math.isfinite(p):
        return float(p)

    def at(v: float) -> float:
        c = crit * math.sqrt(v / df)
        return (stats.norm.sf(c - nc) + stats.norm.cdf(-c - nc)) * stats.chi2.pdf(v, df)

    return float(integrate.quad(at, 0, math.inf, limit=200)[0])


def equivalence(test: TestResult, margin: float) -> float:
    """TOST p-value that the true difference lies within (-margin, +margin): the larger of the one-sided
    p-values of diff > -margin and diff < +margin, with `test`'s se and df. Equivalent when below ALPHA."""
    from scipy import stats

    if not margin > 0:
        raise SignificanceError(f"equivalence: margin {margin} must be positive (state it in advance)")
    if test.se == 0:
        return 0.0 if abs(test.diff) < margin else 1.0
    p_low = stats.t.sf((test.diff + margin) / test.se, test.df)  # H0: diff <= -margin
    p_high = stats.t.cdf((test.diff - margin) / test.se, test.df)  # H0: diff >= +margin
    return float(max(p_low, p_high))


def fmt_p(p: float) -> str:
    """p to two significant digits ("0.013", "0.00021", "1", "<1e-6")."""
    return "<1e-6" if p < 1e-6 else f"{p:.2g}"


def describe(test: TestResult, p_adjusted: float, alpha: float = ALPHA) -> str:
    """One line for a results page: "+0.0253 ± 0.0081 (paired t, n=3; p 0.012, Holm 0.048): a finding" or, when
    not, "...: not a finding (detectable at 80% power: ±0.031)"."""
    head = (f"{test.diff:+.4f} ± {test.se:.4f} ({test.label}; p {fmt_p(test.p)}, "
            f"Holm {fmt_p(p_adjusted)})")
    if is_finding(p_adjusted, alpha):
        return f"{head}: a finding"
    return f"{head}: not a finding (detectable at {POWER:.0%} power: ±{min_detectable(test, alpha=alpha):.4f})"
