"""The gate's statistics on synthetic paired data (no model): interval coverage, the sample-size suggestion, the
three verdicts, calibration (a model against itself never FAILs) and the refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from expertcache.telemetry.errors import InputError
from expertcache.telemetry.metrics import GateThresholds, gate_verdict
from expertcache.telemetry.stats import (check_bootstrap, dacc_interval, dacc_samples_to_resolve, dbpb_interval,
                                         dppl_intervals, resample_counts, samples_to_resolve, tango_interval)

DOMS = ("code", "prose", "math")
T = 127  # tokens per block


def _blocks(rng, n, delta, spread=0.4, base_nll=4.0, sd=0.15):
    """Per-block summed NLLs of a baseline and a candidate whose true mean NLL per token is `delta[d]` nats higher:
    the true Δppl of domain d is 100 * (exp(delta[d]) - 1)."""
    b, c, t = {}, {}, {}
    for d in DOMS:
        b[d] = T * rng.normal(base_nll, sd, n)
        c[d] = b[d] + T * rng.normal(delta[d], spread * 0.01, n)  # paired: the same block, a per-block change
        t[d] = np.full(n, T)
    return b, c, t


def _pct(x):
    return 100 * math.expm1(x)


@pytest.mark.slow  # Monte Carlo coverage (about 2 s)
def test_dppl_interval_covers_the_true_difference_at_about_the_stated_rate():
    rng = np.random.default_rng(0)
    delta = {"code": 0.004, "prose": 0.0, "math": 0.012}
    true_overall = _pct(np.mean(list(delta.values())))
    true_dom = {d: _pct(v) for d, v in delta.items()}
    hits_overall, hits_dom, trials = 0, {d: 0 for d in DOMS}, 200
    for i in range(trials):
        b, c, t = _blocks(rng, 64, delta)
        iv = dppl_intervals(b, c, t, resamples=1000, seed=i)
        hits_overall += iv["overall"][1] <= true_overall <= iv["overall"][2]
        for d in DOMS:
            hits_dom[d] += iv["domains"][d][1] <= true_dom[d] <= iv["domains"][d][2]
    assert hits_overall / trials >= 0.90, hits_overall
    assert sum(hits_dom.values()) / (3 * trials) >= 0.90, hits_dom  # the three domains' intervals pooled


def _paired(rng, n, p_gain, p_loss, p_base=0.6):
    """0/1 scores of a baseline and a candidate on n documents: a document flips to right with probability p_gain
    and to wrong with p_loss (of all documents), so the true Δacc is 100 * (p_gain - p_loss) points."""
    base = (rng.random(n) < p_base).astype(float)
    u = rng.random(n)
    cand = np.where((base == 0) & (u < p_gain / (1 - p_base)), 1.0,
                    np.where((base == 1) & (u < p_loss / p_base), 0.0, base))
    return base, cand


@pytest.mark.slow  # Monte Carlo coverage (about 1 s)
def test_dacc_interval_covers_the_true_difference_at_about_the_stated_rate():
    rng = np.random.default_rng(1)
    hits, trials, n = 0, 300, 200
    for i in range(trials):
        base, cand = _paired(rng, n, 0.08, 0.12)  # true Δacc = -4 points
        _, lo, hi = dacc_interval(base, cand)
        hits += lo <= -4.0 <= hi
    assert hits / trials >= 0.93, hits


@pytest.mark.parametrize("n,p_gain,p_loss", [(16, 0.0, 0.03), (40, 0.01, 0.03), (128, 0.0, 0.02), (60, 0.1, 0.1)])
def test_dacc_interval_is_honest_where_the_runs_rarely_disagree(n, p_gain, p_loss):
    """Few or no discordant documents (where a paired bootstrap reads [0, 0] and misses a real loss): Tango's score
    interval covers the true difference at >= 93% for a 95% level, over 400 seeded draws per case."""
    rng = np.random.default_rng(11)
    truth = 100 * (p_gain - p_loss)
    gains, losses = rng.multinomial(n, [p_gain, p_loss, 1 - p_gain - p_loss], size=400)[:, :2].T
    lo, hi = tango_interval(gains, losses, n)  # vectorised over the draws
    cover = float(np.mean((100 * lo <= truth + 1e-9) & (truth - 1e-9 <= 100 * hi)))
    assert cover >= 0.93, cover
    # the same draws through the 0/1-score entry point agree with the counts
    g, l_ = int(gains[0]), int(losses[0])
    base = np.r_[np.zeros(g), np.ones(l_), np.ones(n - g - l_)]
    cand = np.r_[np.ones(g), np.zeros(l_), np.ones(n - g - l_)]
    assert dacc_interval(base, cand)[1:] == pytest.approx([100 * lo[0], 100 * hi[0]])


@pytest.mark.slow  # brute force over tables (about 1 s)
def test_dacc_interval_against_the_score_test_by_brute_force():
    """The bisection's ends are where the score test with the constrained maximum-likelihood loss rate (found here
    on a grid of q, not by the closed form) stops rejecting."""
    def score(b, c, n, d):
        q = np.linspace(max(0.0, -d) + 1e-12, (1 - d) / 2 - 1e-12, 20001)
        ll = b * np.log(np.maximum(q + d, 1e-300)) + c * np.log(q) + (n - b - c) * np.log(np.maximum(1 - 2 * q - d,
                                                                                                     1e-300))
        q = q[ll.argmax()]
        return (b - c - n * d) / math.sqrt(n * (2 * q + d * (1 - d)))

    for b, c, n in [(5, 2, 100), (12, 2, 50), (1, 0, 20), (7, 11, 60)]:
        lo, hi = tango_interval(b, c, n)
        grid = [d for d in np.linspace(-0.99, 0.99, 1981) if abs(score(b, c, n, d)) <= 1.959964]
        assert grid[0] == pytest.approx(float(lo), abs=2e-3) and grid[-1] == pytest.approx(float(hi), abs=2e-3)


def test_documents_answered_alike_are_not_read_as_certain():
    """16 documents on which both runs answer alike: ±z²/(n+z²) = ±19.4 points at 95%, INCONCLUSIVE against -1,
    and the gate asks for the documents at which the same agreement would resolve it (381: z² · 0.99 / 0.01)."""
    same = (np.arange(16) % 3 == 0).astype(float)
    est, lo, hi = dacc_interval(same, same)
    z2 = 1.959964 ** 2
    assert est == 0.0 and lo == pytest.approx(-100 * z2 / (16 + z2), rel=1e-6) and hi == -lo
    need = dacc_samples_to_resolve(same, same, -1.0)
    assert need == math.ceil(z2 * 0.99 / 0.01) == 381
    dppl = {"overall": [0.0, 0.0, 0.0], **{d: [0.0, 0.0, 0.0] for d in DOMS}}
    v = gate_verdict(dppl, {"ec_cloze_prose": [est, lo, hi]}, {d: 64 for d in DOMS}, {"ec_cloze_prose": 16},
                     dacc_resolve={"ec_cloze_prose": need})
    assert v["gate"] == "INCONCLUSIVE" and v["resolve"]["documents"] == {"ec_cloze_prose": 381}, v
    # at that size the same agreement resolves it, one document fewer does not
    for n, verdict in ((381, "PASS"), (380, "INCONCLUSIVE")):
        x = np.zeros(n)
        iv = dacc_interval(x, x)
        assert gate_verdict(dppl, {"t": iv}, {d: 64 for d in DOMS}, {"t": n})["gate"] == verdict, (n, iv)
    # 128 alike: still INCONCLUSIVE (±2.9 points), as it was under the bootstrap only when a document flipped
    x = np.ones(128)
    assert gate_verdict(dppl, {"t": dacc_interval(x, x)}, {d: 64 for d in DOMS}, {"t": 128})["gate"] == "INCONCLUSIVE"


def test_dacc_interval_narrows_monotonically_with_the_sample():
    """The same gain and loss rates on more documents: every interval strictly inside the one before, the
    estimate unchanged, and the half-width falling about as 1/sqrt(n) once the discordant pairs are many."""
    widths = []
    for n in (25, 50, 100, 200, 400, 800, 1600, 3200):
        lo, hi = tango_interval(0.04 * n, 0.08 * n, n)
        widths.append((float(lo), float(hi)))
    for (lo0, hi0), (lo1, hi1) in zip(widths, widths[1:]):
        assert lo0 < lo1 <= -0.04 <= hi1 < hi0
    w = [hi - lo for lo, hi in widths]
    assert w[-1] / w[-3] == pytest.approx(0.5, abs=0.03)  # 4x the documents: half the width
    # no discordant document: the width falls as 1/n (z²/(n+z²)), faster than a variance rule would promise
    assert [round(float(tango_interval(0, 0, n)[1]) * (n + 1.959964 ** 2), 6) for n in (10, 100, 1000)] == \
        [round(1.959964 ** 2, 6)] * 3


def test_dacc_samples_to_resolve_is_what_resolves_it():
    """At the suggested size the same rates exclude the threshold (PASS above it or FAIL below it); at one
    document fewer they do not."""
    rng = np.random.default_rng(12)

    def straddles(g, l_, n):
        lo, hi = tango_interval(g, l_, n)
        return float(lo) <= -0.01 <= float(hi)

    checked = 0
    for _ in range(30):
        n = int(rng.integers(20, 200))
        g, l_ = rng.multinomial(n, [0.03, 0.02, 0.95])[:2]
        base = np.r_[np.zeros(g), np.ones(l_), np.ones(n - g - l_)]
        cand = np.r_[np.ones(g), np.zeros(l_), np.ones(n - g - l_)]
        need = dacc_samples_to_resolve(base, cand, -1.0)
        if need is None:  # already resolved
            assert not straddles(g, l_, n)
            continue
        checked += 1
        r = lambda m: (g / n * m, l_ / n * m, m)  # noqa: E731 - the same rates on m documents
        assert not straddles(*r(need)), (n, g, l_, need)
        assert need == n + 1 or straddles(*r(need - 1)), (n, g, l_, need)
    assert checked >= 20, checked


def test_dacc_interval_refuses_scores_that_are_not_right_or_wrong():
    with pytest.raises(InputError, match="other than 0 and 1"):
        dacc_interval(np.array([0.5, 1.0]), np.array([1.0, 1.0]), name="t")
    with pytest.raises(InputError, match="same documents"):
        dacc_interval(np.ones(3), np.ones(4), name="t")


def test_bootstrap_is_seeded():
    """Seeded and reproducible (its speed, one multinomial draw and one product per domain, is not a test's
    wall-clock bound: a busy machine would fail it)."""
    rng = np.random.default_rng(2)
    b, c, t = _blocks(rng, 64, {d: 0.005 for d in DOMS})
    iv = dppl_intervals(b, c, t, resamples=2000, seed=7)
    assert iv == dppl_intervals(b, c, t, resamples=2000, seed=7)
    assert iv != dppl_intervals(b, c, t, resamples=2000, seed=8)
    w = resample_counts({"a": 5, "b": 9}, 100, seed=1)
    assert w["a"].shape == (100, 5) and (w["b"].sum(axis=1) == 9).all()
    # adding a stratum changes no other stratum's counts
    assert (resample_counts({"a": 5}, 100, seed=1)["a"] == w["a"]).all()


def test_identical_runs_give_a_zero_width_ppl_interval_and_pass_on_enough_documents():
    rng = np.random.default_rng(3)
    b, _, t = _blocks(rng, 8, {d: 0.0 for d in DOMS})
    iv = dppl_intervals(b, b, t)
    assert iv["overall"] == [0.0, 0.0, 0.0] and iv["max_domain"] == [0.0, 0.0, 0.0]
    dppl = {"overall": iv["overall"], **iv["domains"]}
    acc = np.array([1, 0, 1, 1.0])
    four = dacc_interval(acc, acc)  # 4 documents alike: an interval of ±49 points, not [0, 0]
    assert four[0] == 0.0 and four[1] < -40 and four[2] > 40
    v = gate_verdict(dppl, {"t": four}, iv["n_blocks"], {"t": 4})
    assert v["gate"] == "INCONCLUSIVE" and not v["failures"]
    acc = np.tile(acc, 500)  # 2,000 documents alike: ±0.19 points
    v = gate_verdict(dppl, {"t": dacc_interval(acc, acc)}, iv["n_blocks"], {"t": 2000})
    assert v["gate"] == "PASS" and not v["failures"] and not v["unresolved"]


@pytest.mark.parametrize("iv,acc,verdict", [
    ([0.5, 0.1, 0.9], [0.0, -0.5, 0.5], "PASS"),  # every interval inside
    ([0.5, 0.1, 1.0], [0.0, -1.0, 0.5], "PASS"),  # a bound on the threshold is inside
    ([1.5, 1.1, 1.9], [0.0, -0.5, 0.5], "FAIL"),  # the lower bound of Δppl above +1%
    ([0.5, 0.1, 0.9], [-3.0, -4.0, -2.0], "FAIL"),  # the upper bound of Δacc below -1 point
    ([0.8, 0.2, 1.4], [0.0, -0.5, 0.5], "INCONCLUSIVE"),  # Δppl straddles +1%
    ([0.5, 0.1, 0.9], [0.0, -3.0, 3.0], "INCONCLUSIVE"),  # Δacc straddles -1
    ([1.5, 1.1, 1.9], [0.0, -3.0, 3.0], "FAIL"),  # one outside decides, another straddling or not
])
def test_the_three_verdicts(iv, acc, verdict):
    dppl = {"overall": iv, "code": [0.0, -0.1, 0.1], "prose": [0.0, -0.1, 0.1], "math": [0.0, -0.1, 0.1]}
    v = gate_verdict(dppl, {"ec_cloze_prose": acc}, {d: 64 for d in DOMS}, {"ec_cloze_prose": 24})
    assert v["gate"] == verdict, v
    if verdict == "INCONCLUSIVE":
        need = v["resolve"]["blocks_per_domain"] or v["resolve"]["documents"]["ec_cloze_prose"]
        assert need > 24 and v["unresolved"]


def test_a_domain_interval_across_its_threshold_names_the_blocks_that_resolve_it():
    dppl = {"overall": [0.2, 0.0, 0.4], "code": [1.6, 1.0, 2.6], "prose": [0.0, -0.1, 0.1], "math": [0.0, -0.1, 0.1]}
    v = gate_verdict(dppl, {}, {d: 16 for d in DOMS}, {}, GateThresholds())
    assert v["gate"] == "INCONCLUSIVE"
    # n' = ceil(16 * (w / |est - th|)^2), w = 2.6 - 1.6 on the threshold's side, |est - th| = 0.4
    assert v["resolve"]["blocks_per_domain"] == math.ceil(16 * (1.0 / 0.4) ** 2) == 100
    assert "Δppl code" in v["unresolved"][0] and "100 blocks per domain" in v["unresolved"][0]


def test_samples_to_resolve():
    assert samples_to_resolve(0.5, -0.2, 1.2, 1.0, 64) == math.ceil(64 * (0.7 / 0.5) ** 2)  # below: the upper side
    assert samples_to_resolve(1.4, 0.8, 2.0, 1.0, 64) == math.ceil(64 * (0.6 / 0.4) ** 2)  # above: the lower side
    assert samples_to_resolve(0.5, 0.1, 0.9, 1.0, 64) is None  # already resolved
    assert samples_to_resolve(1.0, 0.5, 1.5, 1.0, 64) == -1  # on the threshold: no sample size resolves it


@pytest.mark.slow  # Monte Carlo (about 1.5 s)
def test_following_the_sample_size_suggestion_shrinks_the_interval_as_promised():
    """At n' blocks per domain (from n = 12) the interval's end on the threshold side should sit about where the
    threshold is now measured from the estimate: half-width(n') ~ |est - threshold| at n. Synthetic, same
    variance; the ratio of the half-width reached to the one promised is ~1 (median over trials)."""
    rng = np.random.default_rng(4)
    delta = {d: math.log1p(0.007) for d in DOMS}  # true Δppl +0.7% in every domain, threshold +1% overall
    ratios, suggested = [], []
    for i in range(60):
        b, c, t = _blocks(rng, 12, delta, spread=1.0)
        iv = dppl_intervals(b, c, t, resamples=1000, seed=i)
        est, lo, hi = iv["overall"]
        n_new = samples_to_resolve(est, lo, hi, 1.0, 12)
        if n_new is None or n_new < 0 or n_new > 5000:
            continue
        promised = abs(est - 1.0)  # the half-width on that side at n_new
        b2, c2, t2 = _blocks(rng, n_new, delta, spread=1.0)
        e2, lo2, hi2 = dppl_intervals(b2, c2, t2, resamples=1000, seed=1000 + i)["overall"]
        reached = (hi2 - e2) if est < 1.0 else (e2 - lo2)
        ratios.append(reached / promised)
        suggested.append(n_new)
    assert len(ratios) >= 20, len(ratios)
    med = float(np.median(ratios))
    assert 0.75 <= med <= 1.33, (med, ratios)
    assert min(suggested) > 12


@pytest.mark.slow  # Monte Carlo (about 1 s)
def test_a_model_against_a_second_evaluation_of_itself_never_fails():
    """Calibration: the candidate is the baseline plus zero-mean per-block noise (a second evaluation with other
    sampling), over 50 seeds and both sample sizes: PASS or INCONCLUSIVE, never FAIL."""
    verdicts, ppl_only = {4: [], 64: []}, []
    for seed in range(50):
        rng = np.random.default_rng(100 + seed)
        for n in (4, 64):
            b, c, t = _blocks(rng, n, {d: 0.0 for d in DOMS}, spread=1.0)
            iv = dppl_intervals(b, c, t, resamples=1000, seed=seed)
            acc = (rng.random(24) < 0.5).astype(float)
            flip = rng.random(24) < 0.1  # a second evaluation flips about 2 of 24 documents either way
            cand = np.where(flip, 1 - acc, acc)
            dacc = {"ec_cloze_prose": dacc_interval(acc, cand)}
            dppl = {"overall": iv["overall"], **iv["domains"]}
            verdicts[n].append(gate_verdict(dppl, dacc, iv["n_blocks"], {"ec_cloze_prose": 24})["gate"])
            if n == 64:
                ppl_only.append(gate_verdict(dppl, {}, iv["n_blocks"], {})["gate"])
    assert "FAIL" not in verdicts[4] + verdicts[64]
    # 24 documents cannot tell ±2 flips from a 1-point loss (INCONCLUSIVE, as it should); 64 blocks resolve Δppl
    assert ppl_only.count("PASS") == 50, ppl_only


def test_a_known_3_percent_degradation_fails_on_64_blocks():
    fails = 0
    for seed in range(20):
        rng = np.random.default_rng(200 + seed)
        b, c, t = _blocks(rng, 64, {d: math.log1p(0.03) for d in DOMS}, spread=1.0)
        iv = dppl_intervals(b, c, t, resamples=1000, seed=seed)
        v = gate_verdict({"overall": iv["overall"], **iv["domains"]}, {}, iv["n_blocks"], {})
        fails += v["gate"] == "FAIL"
    assert fails == 20


def test_bits_per_byte_interval():
    rng = np.random.default_rng(5)
    nbytes = {"p": rng.integers(1000, 2000, 24).astype(float)}
    base = {"p": -nbytes["p"] * rng.normal(1.2, 0.05, 24)}
    est, lo, hi = dbpb_interval(base, base, nbytes)
    assert est == lo == hi == 0.0
    cand = {"p": base["p"] * 1.01}  # 1% more nats on every document: bits per byte up
    est, lo, hi = dbpb_interval(base, cand, nbytes)
    assert 0 < lo <= est <= hi


@pytest.mark.parametrize("confidence,resamples,needle", [
    (0.0, 100, "--confidence"), (1.0, 100, "--confidence"), (1.5, 100, "--confidence"),
    (float("nan"), 100, "--confidence"), (-0.95, 100, "--confidence"),
    (0.95, 0, "--resamples"), (0.95, -10, "--resamples"), (0.95, 2.5, "--resamples"),
    (0.95, 10 ** 9, "--resamples"),
])
def test_bad_interval_options_are_refused(confidence, resamples, needle):
    with pytest.raises(InputError, match=needle):
        check_bootstrap(confidence, resamples)
    rng = np.random.default_rng(6)
    b, c, t = _blocks(rng, 4, {d: 0.0 for d in DOMS})
    with pytest.raises(InputError, match=needle):
        dppl_intervals(b, c, t, confidence=confidence, resamples=resamples)
