"""engram_experiments/significance.py against scipy's own tests, hand-computed Holm values, a large-df closed form and a
Monte Carlo power check."""

import math

import numpy as np
import pytest

stats = pytest.importorskip("scipy.stats", reason="scipy (the train/test extras) computes the p-values")

from engram_experiments import significance as S  # noqa: E402

A = [4.6563, 4.6312, 4.6460]
B = [4.6820, 4.6531, 4.6790]


def test_paired_matches_scipy_ttest_rel():
    r = S.paired(A, B)
    ref = stats.ttest_rel(B, A)
    assert r.kind == "paired" and r.n_a == r.n_b == 3 and r.df == 2
    assert r.diff == pytest.approx(np.mean(np.subtract(B, A)), abs=1e-12)
    assert r.t == pytest.approx(ref.statistic, rel=1e-9)
    assert r.p == pytest.approx(ref.pvalue, rel=1e-9)
    # the hand formula: se = sd(d) / sqrt(n)
    assert r.se == pytest.approx(np.std(np.subtract(B, A), ddof=1) / math.sqrt(3), rel=1e-12)


def test_welch_matches_scipy_ttest_ind():
    b = [4.30, 4.33, 4.31, 4.35]
    r = S.welch(A, b)
    ref = stats.ttest_ind(b, A, equal_var=False)
    assert r.kind == "welch" and (r.n_a, r.n_b) == (3, 4)
    assert r.t == pytest.approx(ref.statistic, rel=1e-9)
    assert r.p == pytest.approx(ref.pvalue, rel=1e-9)
    s = S.welch_summary(np.mean(A), np.std(A, ddof=1), 3, np.mean(b), np.std(b, ddof=1), 4)
    assert (s.p, s.df) == pytest.approx((r.p, r.df), rel=1e-12)
    va, vb = np.var(A, ddof=1) / 3, np.var(b, ddof=1) / 4
    assert r.df == pytest.approx((va + vb) ** 2 / (va**2 / 2 + vb**2 / 3), rel=1e-12)


def test_pairing_matters_when_seeds_share_noise():
    # a shared per-seed offset (the seed's init and data order) dominates: paired sees the +0.01, Welch does not
    offsets = [0.0, 0.05, -0.04]
    a = [4.0 + o for o in offsets]
    b = [4.01 + o + e for o, e in zip(offsets, [0.001, -0.001, 0.0005])]
    assert S.paired(a, b).p < 0.01
    assert S.welch(a, b).p > 0.5


def test_compare_pairs_by_seed_and_falls_back_to_welch():
    a, sa = [1.0, 2.0, 3.0, 4.0], [0, 1, 2, 3]
    b, sb = [2.2, 1.1], [1, 0]  # seeds in another order, only 0 and 1 shared
    r = S.compare(a, b, sa, sb)
    assert r.kind == "paired" and r.n_a == 2
    assert r.diff == pytest.approx(((1.1 - 1.0) + (2.2 - 2.0)) / 2)
    r = S.compare(a, [5.0, 6.0], sa, [0, 9])  # one shared seed: Welch on all values
    assert r.kind == "welch" and (r.n_a, r.n_b) == (4, 2)
    assert S.compare(a, [5.0, 6.0]).kind == "welch"
    with pytest.raises(S.SignificanceError, match="seeds and values disagree"):
        S.compare(a, b, sa, [0])


def test_holm_hand_computed():
    # sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1 = 0.02, 0.03, 0.06, 0.04 -> monotone 0.02, 0.03, 0.06, 0.06
    assert S.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert S.holm([0.5, 0.9]) == [1.0, 1.0]  # capped
    assert S.holm([0.02]) == [0.02]
    assert S.holm([]) == []
    adj = S.holm([0.012, 0.013])
    assert [S.is_finding(p) for p in adj] == [True, True]  # 0.024, 0.026
    assert not S.is_finding(S.holm([0.03, 0.04, 0.2])[0])  # 0.09


def test_min_detectable_closed_form_and_power():
    # df -> infinity: the normal approximation delta = (z_{1-alpha/2} + z_power) x se (ignoring the far tail)
    big = S.TestResult("welch", 0.0, 1.0, 1e7, 0.0, 1.0, 10**7, 10**7)
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    assert S.min_detectable(big) == pytest.approx(z, rel=1e-4)
    # the power at the returned delta is 80%, by simulation of the paired test at n = 3
    r = S.paired(A, B)
    delta = S.min_detectable(r)
    sd = r.se * math.sqrt(3)
    rng = np.random.default_rng(0)
    d = rng.normal(delta, sd, size=(40000, 3))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(3))
    power = np.mean(np.abs(t) > stats.t.ppf(0.975, 2))
    assert power == pytest.approx(0.80, abs=0.01)
    # two pairs (df 1), where scipy's nct gives nan at large noncentrality: the integral fallback, checked by simulation
    r2 = S.paired(A[:2], B[:2])
    delta2 = S.min_detectable(r2)
    d = rng.normal(delta2, r2.se * math.sqrt(2), size=(40000, 2))
    t = d.mean(1) / (d.std(1, ddof=1) / math.sqrt(2))
    assert np.mean(np.abs(t) > stats.t.ppf(0.975, 1)) == pytest.approx(0.80, abs=0.01)
    # at n = 3 (df 2) the detectable difference is much more than 2 se
    assert delta > 5 * r.se
    with pytest.raises(S.SignificanceError, match="power"):
        S.min_detectable(r, power=0.01)


def test_equivalence_matches_two_one_sided_scipy_tests():
    d = np.subtract(B, A)
    r = S.paired(A, B)
    for margin in (0.02, 0.05, 0.1):
        lo = stats.ttest_1samp(d, -margin, alternative="greater").pvalue
        hi = stats.ttest_1samp(d, margin, alternative="less").pvalue
        assert S.equivalence(r, margin) == pytest.approx(max(lo, hi), rel=1e-9)
    assert S.equivalence(r, 0.2) < 0.05 < S.equivalence(r, 0.02)
    with pytest.raises(S.SignificanceError, match="margin"):
        S.equivalence(r, 0.0)


def test_bad_input_is_one_clear_error():
    with pytest.raises(S.SignificanceError, match="at least 2"):
        S.welch([1.0], [1.0, 2.0])
    with pytest.raises(S.SignificanceError, match="pair them"):
        S.paired([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(S.SignificanceError, match="not finite"):
        S.paired([1.0, float("nan")], [1.0, 2.0])


def test_describe_says_finding_or_what_could_be_seen():
    r = S.paired(A, B)
    assert S.describe(r, 0.01).endswith(": a finding")
    line = S.describe(r, 0.2)
    assert "not a finding" in line and f"±{S.min_detectable(r):.4f}" in line and "paired t, n=3" in line
    assert S.fmt_p(0.01234) == "0.012" and S.fmt_p(0.004321) == "0.0043" and S.fmt_p(1e-9) == "<1e-6"
