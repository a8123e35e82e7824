"""The one alternation harness and the one claim rule of every benchmark (METRICS.md: speedups are ratios measured in
the same run, A and B alternated, never two absolute times from different runs).

`alternate` runs arms A, B, C ... for `rounds` rounds, the order reversed every other round (A B C, C B A, ...) so
neither arm always runs on a warmer machine; with `keep_first` the first arm (the baseline) leads every round and
only the others reverse (A B C, A C B, ...). Each call of `run(arm, round)` is one round of one arm: in this
process (a closure over a model), or in a process of its own (`runner.run_child` in the closure): the caller says.

`claimed` is the rule under every ratio a benchmark prints (bench decode's `vs_*_claimed`, the replay's
`tpot_ratio_claimed`, bench big's comparisons, every script's A/B): a ratio is claimed only when each side ran at
least `MIN_ROUNDS` rounds and the rounds are apart (every round median of one faster than every round median of
the other). Apart rounds imply that every paired per-round ratio lies on the same side of 1, never the reverse.
"""

from __future__ import annotations

from typing import Callable, Sequence, TypeVar

import numpy as np

T = TypeVar("T")
MIN_ROUNDS = 3  # fewer rounds claim nothing, however far apart they are


def order(arms: Sequence[str], r: int, keep_first: bool = False) -> list[str]:
    """Round `r`'s order: as given on even rounds, reversed on odd ones (`keep_first`: the first arm stays first)."""
    arms = list(arms)
    if r % 2 == 0:
        return arms
    return arms[:1] + arms[:0:-1] if keep_first else arms[::-1]


def alternate(arms: Sequence[str], rounds: int, run: Callable[[str, int], T], keep_first: bool = False,
              before_round: Callable[[int], None] | None = None,
              after: Callable[[str, int, T], None] | None = None) -> dict[str, list[T]]:
    """`{arm: [run(arm, 0), run(arm, 1), ...]}`, the arms alternated round by round (`order`). `before_round(r)`
    runs at the start of each round (a bandwidth probe, a compute-only pass); `after(arm, r, result)` after each
    run (progress)."""
    if len(set(arms)) < len(arms):
        raise ValueError(f"arms {list(arms)}: an arm is named twice")
    out: dict[str, list[T]] = {a: [] for a in arms}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for a in order(arms, r, keep_first):
            res = run(a, r)
            out[a].append(res)
            if after is not None:
                after(a, r, res)
    return out


def claimed(a: Sequence[float], b: Sequence[float], min_rounds: int = MIN_ROUNDS) -> bool:
    """Whether the ratio of `a` to `b` (their round medians) may be claimed: each ran at least `min_rounds` rounds
    and the rounds are apart (every round of one faster than every round of the other)."""
    a, b = [float(x) for x in a], [float(x) for x in b]
    return min(len(a), len(b)) >= min_rounds and (max(a) < min(b) or max(b) < min(a))


def spread(rounds: Sequence[float]) -> dict:
    """A figure's rounds: their median and their range."""
    x = np.asarray(rounds, dtype=float)
    return {"median": float(np.median(x)), "min": float(x.min()), "max": float(x.max()), "rounds": int(len(x))}


def compare(a: Sequence[float], b: Sequence[float]) -> dict:
    """A against B from their round medians: the ratio of the medians, each side's range and count of rounds, and
    whether the ratio is claimed (`claimed`)."""
    return {"ratio": float(np.median(a) / np.median(b)), "a_rounds_s": [float(min(a)), float(max(a))],
            "b_rounds_s": [float(min(b)), float(max(b))], "rounds": [len(a), len(b)], "claimed": claimed(a, b)}


def tpot_figures(tpot: dict[str, Sequence[float]]) -> dict:
    """Each arm's time per output token over all its timed tokens: `tpot_median_s` and `tpot_p90_s`, by arm."""
    return {"tpot_median_s": {k: float(np.median(v)) for k, v in tpot.items()},
            "tpot_p90_s": {k: float(np.percentile(v, 90)) for k, v in tpot.items()}}


def claim_text(c: dict) -> str:
    """A `compare` result's claim as a table says it: yes, or why not (too few rounds on a side, or the rounds
    overlap)."""
    if c["claimed"]:
        return "yes"
    n = c.get("rounds")
    if n and min(n) < MIN_ROUNDS:
        return f"no: {min(n)} round{'s' if min(n) != 1 else ''} on one side, {MIN_ROUNDS} needed"
    return "no: the rounds overlap"
