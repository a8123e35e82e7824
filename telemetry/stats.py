"""Paired intervals for the quality gate (METRICS.md, "gate"): one seeded, vectorised paired bootstrap, and the
sample size that would resolve an interval that straddles a threshold.

Both runs of a gate score the same step-wise blocks and the same lm-eval documents, so every statistic here is
computed on paired items: a resample draws item indices once (with replacement, within each stratum: a domain
or a task) and applies them to both runs. Resampling is one array operation: the bootstrap counts of every
resample come from one multinomial draw, `[resamples, n]`, and a statistic over all resamples is one matrix
product; there is no Python loop per resample.

- Δppl (in %): `100 * (exp(Σ nll_cand - Σ nll_base) / Σ tokens) - 1)` over the resampled blocks of a domain;
  overall pools the domains' resampled sums (a stratified bootstrap: every domain keeps its block count, as the
  evaluation fixes it); the worst domain is the largest domain Δppl of each resample.
- Δacc (in points): `100 * mean(correct_cand - correct_base)` over the resampled documents of a task.
- Δ bits per byte: `mean over tasks of -Σ ll / (Σ bytes * ln 2)` of the candidate minus the baseline's, on the
  same resampled documents.

An interval is the expanded percentile interval of the resampled statistic at the given level (default 0.95):
the percentiles are taken at `Phi(-sqrt(n/(n-1)) * t_{(1+level)/2, n-1})` and its complement rather than at
`(1-level)/2` (Hesterberg 2015), so that 4 blocks or 8 documents are not read as more certain than they are; n is
the items of the stratum (all strata's for the pooled overall figures, the smallest domain's for the worst).
`samples_to_resolve` gives the sample size at which an interval straddling a threshold would exclude it, at the
observed variance: `n' = ceil(n * (w / |est - threshold|)^2)`, with `w` the distance from the estimate to the
interval's end on the threshold's side (the half-width shrinks as 1/sqrt(n)).

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


def dacc_interval(base: np.ndarray, cand: np.ndarray, confidence: float = DEFAULT_CONFIDENCE,
                  resamples: int = DEFAULT_RESAMPLES, seed: int = 0, name: str = "task") -> list[float]:
    """Δacc in points with a paired interval, from per-document scores in [0, 1] of the same documents:
    `[est, low, high]`."""
    check_bootstrap(confidence, resamples)
    d = np.asarray(cand, np.float64) - np.asarray(base, np.float64)
    w = resample_counts({name: len(d)}, resamples, seed)[name]
    return [float(100 * d.mean()), *percentile_interval(100 * (w @ d) / len(d), confidence, len(d))]


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
