"""Paired intervals for the quality gate (METRICS.md, "gate"): a seeded, vectorised paired bootstrap for the
perplexity side, Tango's score interval for the paired accuracy difference, and the sample size that would
resolve an interval that straddles a threshold.

Both runs of a gate score the same step-wise blocks and the same lm-eval documents, so every statistic here is
computed on paired items. For Δppl and bits per byte a resample draws item indices once (with replacement, within
each stratum: a domain or a task) and applies them to both runs. Resampling is one array operation: the bootstrap
counts of every resample come from one multinomial draw, `[resamples, n]`, and a statistic over all resamples is
one matrix product; there is no Python loop per resample.

- Δppl (in %): `100 * (exp(Σ nll_cand - Σ nll_base) / Σ tokens) - 1)` over the resampled blocks of a domain;
  overall pools the domains' resampled sums (a stratified bootstrap: every domain keeps its block count, as the
  evaluation fixes it); the worst domain is the largest domain Δppl of each resample.
- Δacc (in points): `100 * (gains - losses) / n` over a task's n documents scored 0/1 by both runs (gains: right
  only for the candidate, losses: right only for the baseline). Its interval is not a bootstrap: a bootstrap of
  documents on which the two runs agree everywhere has nothing to resample and reads [0, 0] on 16 documents as
  on 16,000. It is Tango's score interval for a difference of paired proportions (Tango 1998; Newcombe 1998,
  method 8's score form): the values δ that the score test of `δ = p_gain - p_loss` does not reject at the level,
  the variance taken under δ itself (`2 q + δ (1 - δ)`, q the constrained maximum-likelihood loss rate), so no
  discordant pair gives `±z² / (n + z²)` (±19 points on 16 documents, ±0.19 on 2,000), never [0, 0].
- Δ bits per byte: `mean over tasks of -Σ ll / (Σ bytes * ln 2)` of the candidate minus the baseline's, on the
  same resampled documents.

A bootstrap interval is the expanded percentile interval of the resampled statistic at the given level (default
0.95): the percentiles are taken at `Phi(-sqrt(n/(n-1)) * t_{(1+level)/2, n-1})` and its complement rather than at
`(1-level)/2` (Hesterberg 2015), so that 4 blocks are not read as more certain than they are; n is the items of
the stratum (all strata's for the pooled overall figures, the smallest domain's for the worst).
`samples_to_resolve` gives the sample size at which an interval straddling a threshold would exclude it, at the
observed variance: `n' = ceil(n * (w / |est - threshold|)^2)`, with `w` the distance from the estimate to the
interval's end on the threshold's side (the half-width shrinks as 1/sqrt(n)). For Δacc `dacc_samples_to_resolve`
is exact for the score interval: at the observed gain and loss rates the score statistic at the threshold grows
as sqrt(n), so `n' = ceil(n * (z / Z_n(threshold))^2)`.

The trainer's end-of-run gate and `expertcache.evals.gate` both use it.
"""

from __future__ import annotations

import math
import zlib
from statistics import NormalDist

import numpy as np

from expertcache.telemetry.errors import InputError

DEFAULT_CONFIDENCE = 0.95
DEFAULT_RESAMPLES = 2000
MAX_RESAMPLES = 200_000  # the counts are one [resamples, n] array per stratum: this bounds its memory


def check_bootstrap(confidence: float, resamples: int) -> None:
    """An interval level in (0, 1) and at least one resample; an `InputError` otherwise."""
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not math.isfinite(confidence) \
            or not 0 < confidence < 1:
        raise InputError(f"--confidence {confidence!r}: an interval level in (0, 1) expected, e.g. 0.95")
    if isinstance(resamples, bool) or not isinstance(resamples, (int, np.integer)) or not 1 <= resamples <= \
            MAX_RESAMPLES:
        raise InputError(f"--resamples {resamples!r}: a whole number of bootstrap resamples from 1 to "
                         f"{MAX_RESAMPLES} expected (default {DEFAULT_RESAMPLES})")


def resample_counts(sizes: dict[str, int], resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict[str, np.ndarray]:
    """Bootstrap counts per stratum: `{name: [resamples, n] float64}`, row r = how often resample r draws each of
    the stratum's n items (each row sums to n). Seeded: the same sizes, resamples and seed give the same counts;
    each stratum from its own stream, keyed by its name (adding a stratum changes no other's counts)."""
    out = {}
    for name in sorted(sizes):
        n = int(sizes[name])
        if n < 1:
            raise InputError(f"{name}: no items to resample")
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode()), n])
        out[name] = rng.multinomial(n, np.full(n, 1.0 / n), size=int(resamples)).astype(np.float64)
    return out


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (Cornish-Fisher expansion around the normal's, Abramowitz & Stegun 26.7.5; within
    1% of the exact value from 3 degrees of freedom, exact in the limit; no scipy)."""
    z = NormalDist().inv_cdf(p)
    v = float(df)
    return (z + (z ** 3 + z) / (4 * v) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * v ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * v ** 3)
            + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / (92160 * v ** 4))


def expanded_level(confidence: float, n: int) -> float:
    """The lower tail probability of the expanded percentile interval (Hesterberg 2015): the plain percentile
    bootstrap is too narrow on small samples (its spread is the plug-in's, n-1 in place of n, and a normal's tails
    in place of a t's); its percentiles are taken at `Phi(-sqrt(n / (n - 1)) * t_{(1 + confidence) / 2, n - 1})`
    instead of `(1 - confidence) / 2`. One item: 0 (the interval is the single value)."""
    if n < 2:
        return 0.0
    return NormalDist().cdf(-math.sqrt(n / (n - 1)) * t_quantile((1 + confidence) / 2, n - 1))


def percentile_interval(reps: np.ndarray, confidence: float = DEFAULT_CONFIDENCE,
                        n: int | None = None) -> tuple[float, float]:
    """The percentile interval of the resampled statistic `reps`; expanded for a sample of `n` items when given."""
    a = (1 - confidence) / 2 if n is None else expanded_level(confidence, n)
    lo, hi = np.quantile(reps, [a, 1 - a])
    return float(lo), float(hi)


def _pct(dnll: np.ndarray | float) -> np.ndarray | float:
    return 100 * np.expm1(dnll)


def dppl_intervals(base_nll: dict[str, np.ndarray], cand_nll: dict[str, np.ndarray], tokens: dict[str, np.ndarray],
                   confidence: float = DEFAULT_CONFIDENCE, resamples: int = DEFAULT_RESAMPLES, seed: int = 0) -> dict:
    """Δppl in % with paired intervals, per domain, overall and worst domain, from per-block summed NLLs (nats)
    and token counts: `{'domains': {d: [est, low, high]}, 'overall': [...], 'max_domain': [...],
    'n_blocks': {d: n}}`."""
    check_bootstrap(confidence, resamples)
    doms = sorted(base_nll)
    diff = {d: np.asarray(cand_nll[d], np.float64) - np.asarray(base_nll[d], np.float64) for d in doms}
    tok = {d: np.asarray(tokens[d], np.float64) for d in doms}
    w = resample_counts({d: len(diff[d]) for d in doms}, resamples, seed)
    num = {d: w[d] @ diff[d] for d in doms}  # [R] resampled NLL difference sums
    den = {d: w[d] @ tok[d] for d in doms}  # [R] resampled token counts
    out: dict = {"domains": {}, "n_blocks": {d: len(diff[d]) for d in doms}}
    dom_reps = []
    for d in doms:
        reps = _pct(num[d] / den[d])
        dom_reps.append(reps)
        out["domains"][d] = [float(_pct(diff[d].sum() / tok[d].sum())),
                             *percentile_interval(reps, confidence, len(diff[d]))]
    all_num, all_den = sum(num.values()), sum(den.values())
    est = float(_pct(sum(diff[d].sum() for d in doms) / sum(tok[d].sum() for d in doms)))
    n_all = sum(out["n_blocks"].values())
    out["overall"] = [est, *percentile_interval(_pct(all_num / all_den), confidence, n_all)]
    worst = np.max(np.stack(dom_reps), axis=0)
    out["max_domain"] = [max(v[0] for v in out["domains"].values()),
                         *percentile_interval(worst, confidence, min(out["n_blocks"].values()))]
    return out


def _paired_counts(base, cand, name: str) -> tuple[int, int, int]:
    """(gains, losses, n) of two runs' 0/1 scores on the same documents; an `InputError` for anything else."""
    b, c = np.asarray(base, np.float64), np.asarray(cand, np.float64)
    if b.ndim != 1 or b.shape != c.shape or len(b) < 1:
        raise InputError(f"{name}: {b.shape} and {c.shape} per-document scores; one score per document of the same "
                         f"documents expected from both runs")
    if not (np.isin(b, (0.0, 1.0)).all() and np.isin(c, (0.0, 1.0)).all()):
        raise InputError(f"{name}: per-document accuracy scores other than 0 and 1; the paired accuracy interval "
                         f"needs each document right (1) or wrong (0)")
    return int(((c == 1) & (b == 0)).sum()), int(((c == 0) & (b == 1)).sum()), len(b)


def _z(confidence: float) -> float:
    return NormalDist().inv_cdf((1 + confidence) / 2)


def tango_score(gains, losses, n, delta) -> np.ndarray:
    """Tango's score statistic for `p_gain - p_loss = delta` (a proportion in [-1, 1]) on n paired documents, gains
    and losses discordant counts (arrays broadcast): `(gains - losses - n delta) / sqrt(n (2 q + delta (1 - delta)))`,
    q the loss rate's maximum-likelihood value under that delta. Decreasing in delta; +-inf where the variance
    is 0 and the numerator is not, 0 where both are."""
    b, c, n, d = (np.asarray(x, np.float64) for x in (gains, losses, n, delta))
    A = 2 * n
    B = -b - c + (2 * n - b + c) * d
    C = -c * d * (1 - d)
    q = (np.sqrt(np.maximum(B * B - 4 * A * C, 0.0)) - B) / (2 * A)
    var = n * np.maximum(2 * q + d * (1 - d), 0.0)
    num = b - c - n * d
    with np.errstate(divide="ignore", invalid="ignore"):
        z = num / np.sqrt(var)
    return np.where(num == 0, 0.0, z)


def tango_interval(gains, losses, n, confidence: float = DEFAULT_CONFIDENCE, iters: int = 60
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(low, high) proportions of Tango's score interval for `p_gain - p_loss` at `confidence`: the deltas whose
    score statistic lies in [-z, +z] (it decreases in delta, so bisection on [-1, estimate] for the low end and on
    [estimate, 1] for the high end, vectorised over arrays of counts; 60 halvings leave < 1e-17)."""
    b, c, n = np.broadcast_arrays(*(np.asarray(x, np.float64) for x in (gains, losses, n)))
    z = _z(confidence)
    est = (b - c) / n
    # low end: `out` rejected (score > z), `inn` accepted; -1 itself accepted -> -1
    out, inn = -np.ones_like(est), est.copy()
    for _ in range(iters):
        mid = (out + inn) / 2
        rej = tango_score(b, c, n, mid) > z
        out, inn = np.where(rej, mid, out), np.where(rej, inn, mid)
    low = np.where(tango_score(b, c, n, -1.0) > z, inn, -1.0)
    inn, out = est.copy(), np.ones_like(est)
    for _ in range(iters):
        mid = (out + inn) / 2
        rej = tango_score(b, c, n, mid) < -z
        out, inn = np.where(rej, mid, out), np.where(rej, inn, mid)
    high = np.where(tango_score(b, c, n, 1.0) < -z, inn, 1.0)
    return low, high


def dacc_interval(base: np.ndarray, cand: np.ndarray, confidence: float = DEFAULT_CONFIDENCE,
                  name: str = "task") -> list[float]:
    """Δacc in points with Tango's paired score interval, from per-document 0/1 scores of the same documents:
    `[est, low, high]`."""
    check_bootstrap(confidence, 1)
    g, l, n = _paired_counts(base, cand, name)
    lo, hi = tango_interval(g, l, n, confidence)
    return [100 * (g - l) / n, float(100 * lo), float(100 * hi)]


def dacc_samples_to_resolve(base: np.ndarray, cand: np.ndarray, threshold: float,
                            confidence: float = DEFAULT_CONFIDENCE, name: str = "task") -> int | None:
    """Documents at which the score interval of Δacc would exclude `threshold` (points) at today's gain and loss
    rates: the score statistic at the threshold grows as sqrt(n), so `ceil(n * (z / Z_n)^2)`. None when the
    interval already excludes it; -1 when the estimate sits on the threshold (no sample size resolves it)."""
    g, l, n = _paired_counts(base, cand, name)
    s = float(tango_score(g, l, n, threshold / 100))
    z = _z(confidence)
    if abs(s) > z:
        return None
    if s == 0:
        return -1
    return max(n + 1, math.ceil(n * (z / abs(s)) ** 2 - 1e-9))


def dbpb_interval(base_ll: dict[str, np.ndarray], cand_ll: dict[str, np.ndarray], nbytes: dict[str, np.ndarray],
                  confidence: float = DEFAULT_CONFIDENCE, resamples: int = DEFAULT_RESAMPLES,
                  seed: int = 0) -> list[float]:
    """Δ bits per byte (candidate - baseline; tasks pooled by their mean, as lm-eval's figures are) with a paired
    interval, from per-document log-likelihoods (nats) and byte counts: `[est, low, high]`."""
    check_bootstrap(confidence, resamples)
    tasks = sorted(base_ll)
    w = resample_counts({t: len(base_ll[t]) for t in tasks}, resamples, seed)
    est, reps = 0.0, 0.0
    for t in tasks:
        b, c, n = (np.asarray(x[t], np.float64) for x in (base_ll, cand_ll, nbytes))
        est = est + ((b.sum() - c.sum()) / n.sum()) / math.log(2)
        reps = reps + ((w[t] @ b - w[t] @ c) / (w[t] @ n)) / math.log(2)
    est, reps = est / len(tasks), reps / len(tasks)
    return [float(est), *percentile_interval(np.asarray(reps), confidence, sum(len(base_ll[t]) for t in tasks))]


def samples_to_resolve(est: float, low: float, high: float, threshold: float, n: int) -> int | None:
    """Items (blocks per domain, documents per task) at which the interval `[low, high]` around `est` would exclude
    `threshold`, at the observed variance: `ceil(n * (w / |est - threshold|)^2)`, w the distance from `est` to the
    interval's end on the threshold's side. None when the interval already excludes it; -1 when the estimate
    sits on the threshold (no sample size resolves it)."""
    if not low <= threshold <= high:
        return None
    gap = abs(est - threshold)
    if gap < 1e-12:
        return -1
    w = est - low if est > threshold else high - est
    return max(n + 1, math.ceil(n * (w / gap) ** 2 - 1e-9))  # (a rounding error never adds an item)
