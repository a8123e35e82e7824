"""The cache simulator against brute force and naive references on small random traces."""

import functools
import itertools

import numpy as np
import pytest

from expertcache.telemetry.cachesim import global_steps, simulate
from expertcache.telemetry.errors import InputError


def random_steps(rng, n, e, k, sticky=0.5):
    rows, prev = [], None
    for _ in range(n):
        if prev is not None and rng.random() < sticky:
            keep = [x for x in prev if rng.random() < 0.7]
            pool = [x for x in range(e) if x not in keep]
            row = keep + list(rng.choice(pool, k - len(keep), replace=False))
        else:
            row = list(rng.choice(e, k, replace=False))
        rows.append([int(x) for x in row])
        prev = row
    return np.array(rows)


def optimal_hits(rows, cap, token=True):
    """Exhaustive search over every choice: the most hits any policy can get. Token semantics: after a step the
    cache may hold any C keys of (resident ∪ step). Reference semantics: each miss evicts any key or none."""
    rows = [tuple(r) for r in rows]

    @functools.lru_cache(maxsize=None)
    def best(s, cache):
        if s == len(rows):
            return 0
        r = rows[s]
        hits = sum(e in cache for e in r)
        miss = [e for e in r if e not in cache]
        if token:
            pool = sorted(cache | set(r))
            nexts = [frozenset(c) for n in range(min(cap, len(pool)) + 1) for c in itertools.combinations(pool, n)]
            return hits + max(best(s + 1, c) for c in nexts)
        outcomes = []

        def place(cache, todo):
            if not todo:
                outcomes.append(cache)
                return
            e, rest = todo[0], todo[1:]
            if len(cache) < cap:
                place(cache | {e}, rest)
                return
            cands = list(cache)
            if not cands:
                place(cache, rest)
            for v in cands:
                place((cache - {v}) | {e}, rest)
        place(frozenset(cache), miss)
        return hits + max(best(s + 1, c) for c in set(outcomes))
    return best(0, frozenset())


@pytest.mark.parametrize("k,cap", [(1, 2), (1, 3), (2, 2), (2, 3), (2, 4), (3, 2)])
def test_belady_token_is_optimal(k, cap):
    rng = np.random.default_rng(k * 10 + cap)
    for _ in range(25):
        steps = random_steps(rng, 9, 6, k)
        got = simulate(steps, cap, "belady", "token").hits
        assert got == optimal_hits(steps, cap, token=True), steps.tolist()


def test_belady_reference_k1_is_optimal():
    rng = np.random.default_rng(3)
    for _ in range(25):
        steps = random_steps(rng, 10, 5, 1)
        assert simulate(steps, 2, "belady", "reference").hits == optimal_hits(steps, 2, token=False)


def naive_lru(rows, cap, token):
    """token: recency = (step, position in step), never evicting a key of the current step.
    reference: recency = step index, ties to the smallest key."""
    cache, hits = {}, 0  # key -> (step, position) of its last use
    for s, r in enumerate(rows):
        if token:
            hits += sum(e in cache for e in r)
            for e in r:
                if e not in cache and len(cache) >= cap:
                    cands = [v for v in cache if v not in r]
                    if not cands:
                        continue
                    del cache[min(cands, key=cache.get)]
                cache[e] = (s, -1)
            for j, e in enumerate(r):
                if e in cache:
                    cache[e] = (s, j)
        else:  # reference: recency = step index, ties to the smallest key
            for e in r:
                if e in cache:
                    hits += 1
                elif len(cache) >= cap:
                    del cache[min(cache, key=lambda v: (cache[v][0], v))]
                cache[e] = (s, 0)
    return hits


@pytest.mark.parametrize("semantics", ["token", "reference"])
def test_lru_matches_naive(semantics):
    rng = np.random.default_rng(1)
    for _ in range(30):
        steps = random_steps(rng, 40, 10, 3)
        for cap in (2, 3, 5, 8):
            exp = naive_lru(steps.tolist(), cap, semantics == "token")
            assert simulate(steps, cap, "lru", semantics).hits == exp


def test_policies_are_bounded_by_belady_and_full_cache_hits_all_but_cold_misses():
    rng = np.random.default_rng(2)
    steps = random_steps(rng, 300, 16, 4, sticky=0.7)
    for cap in (4, 6, 8):
        bel = simulate(steps, cap, "belady").hits
        for pol in ("lru", "lfu", "static"):
            assert simulate(steps, cap, pol).hits <= bel
    full = simulate(steps, 16, "lru")
    assert full.accesses - full.hits == len(np.unique(steps))  # only cold misses


def test_static_pins_the_most_frequent_keys_of_the_fit_steps():
    fit = np.array([[0, 1], [0, 2], [0, 1], [3, 1]])
    score = np.array([[0, 1], [2, 3], [1, 4]])
    r = simulate(score, 2, "static", fit=fit)  # pins {0, 1}
    assert (r.hits, r.accesses) == (3, 6)


def test_global_steps_are_token_major():
    ids = np.array([[[0, 1], [2, 3]], [[1, 0], [3, 2]]])  # [layers=2, tokens=2, k=2]
    g = global_steps(ids, num_experts=4)
    assert g.tolist() == [[0, 1], [5, 4], [2, 3], [7, 6]]


def test_bad_arguments():
    with pytest.raises(InputError, match="capacity must be at least 1"):
        simulate(np.zeros((2, 2), int), 0)
    with pytest.raises(InputError, match="unknown cache policy 'fifo'"):
        simulate(np.zeros((2, 2), int), 2, "fifo")
