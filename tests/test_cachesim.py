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
    with pytest.raises(InputError, match="capacity must be a whole number of experts >= 1"):
        simulate(np.zeros((2, 2), int), 0)
    with pytest.raises(InputError, match="unknown cache policy 'fifo'"):
        simulate(np.zeros((2, 2), int), 2, "fifo")


# --- the compiled kernels against the one state machine (telemetry.cache.CacheState) ----------------------------

def _drive_state(steps, cap, policy, keep=None, pinned=None):
    """Hits of CacheState driven step by step (the definition), through cachesim.drive."""
    from expertcache.telemetry.cache import CacheState
    from expertcache.telemetry.cachesim import drive

    rows = steps.tolist()
    return drive(rows, CacheState(cap, steps.shape[1], policy, pinned), keep)[0]


def _kernel_cases(seed, n_traces=40):
    rng = np.random.default_rng(seed)
    for _ in range(n_traces):
        e = int(rng.integers(3, 30))
        k = int(rng.integers(1, min(8, e) + 1))
        steps = random_steps(rng, int(rng.integers(1, 120)), e, k, sticky=float(rng.random()))
        for cap in sorted({1, max(1, k - 1), k, min(e, k + 1), max(1, e // 2), e}):
            yield rng, e, k, steps, cap


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_kernels_equal_the_state_machine(policy):
    n = 0
    for _, _, _, steps, cap in _kernel_cases(11 if policy == "lru" else 12):
        assert simulate(steps, cap, policy, "token").hits == _drive_state(steps, cap, policy), (steps.tolist(), cap)
        n += 1
    assert n > 100


def test_static_equals_the_state_machine():
    from expertcache.telemetry.cachesim import _pins

    for _, _, _, steps, cap in _kernel_cases(13):
        fit = steps[: max(1, len(steps) // 3)]
        assert simulate(steps, cap, "static", fit=fit).hits == _drive_state(steps, cap, "static",
                                                                           pinned=_pins(fit, cap))


def test_scored_kernel_equals_the_state_machine_including_ties():
    from expertcache.telemetry.cachesim import simulate_scored

    for rng, e, _, steps, cap in _kernel_cases(14):
        for keep in (rng.random((len(steps), e)), rng.integers(0, 3, (len(steps), e)).astype(float)):  # ties too
            assert simulate_scored(steps, cap, keep).hits == _drive_state(steps, cap, "scored", keep=keep), cap


def test_belady_equals_the_scored_state_machine_ranked_by_next_use():
    """Token-semantics Belady is CacheState's scored policy keeping the keys used soonest (its own docstring)."""
    from expertcache.telemetry.cachesim import next_use_steps

    for _, e, _, steps, cap in _kernel_cases(15):
        keep = -next_use_steps(steps, e).astype(float)
        assert simulate(steps, cap, "belady", "token").hits == _drive_state(steps, cap, "scored", keep=keep)


def _lfu_reference_naive(rows, cap):
    count, last, cache, hits = {}, {}, set(), 0
    for s, r in enumerate(rows):
        for e in r:
            count[e] = count.get(e, 0) + 1
            last[e] = s
            if e in cache:
                hits += 1
                continue
            if len(cache) >= cap:
                cache.remove(min(cache, key=lambda v: (count[v], last[v], v)))
            cache.add(e)
    return hits


def test_lfu_reference_matches_naive():
    for _, _, _, steps, cap in _kernel_cases(16):
        assert simulate(steps, cap, "lfu", "reference").hits == _lfu_reference_naive(steps.tolist(), cap)


def test_global_budget_kernels_equal_the_state_machine():
    """Global keys (layer * E + e, token-major) through every compiled policy, heaps compacted many times."""
    rng = np.random.default_rng(17)
    ids = np.stack([random_steps(rng, 300, 16, 4) for _ in range(3)])  # [3 layers, 300 tokens, 4]
    steps = global_steps(ids, 16)
    for cap in (3, 4, 9, 24, 48):
        for policy in ("lru", "lfu"):
            assert simulate(steps, cap, policy).hits == _drive_state(steps, cap, policy)


def test_scored_chunks_carry_their_state():
    """ScoredCache fed in chunks (a global budget over 3 blocks) equals one pass, and equals CacheState driven
    with the global keep rows (each block's slice updated when its layer runs)."""
    from expertcache.telemetry.cachesim import ScoredCache

    rng = np.random.default_rng(18)
    n_l, n_t, e = 3, 90, 12
    ids = np.stack([random_steps(rng, n_t, e, 3) for _ in range(n_l)])
    keep = rng.random((n_t, n_l, e))
    rows, full = [], np.full(n_l * e, -np.inf)
    for t in range(n_t):
        for i in range(n_l):
            full[i * e:(i + 1) * e] = keep[t, i]
            rows.append(full.copy())
    for cap in (2, 5, 17):
        exp = _drive_state(global_steps(ids, e), cap, "scored", keep=np.asarray(rows))
        one = ScoredCache(cap, n_l, e)
        one.run(ids, keep)
        parts = ScoredCache(cap, n_l, e)
        for a, b in ((0, 1), (1, 40), (40, 41), (41, 90)):
            parts.run(ids[:, a:b], keep[a:b])
        assert one.hits == parts.hits == exp, cap
        assert parts.accesses == ids.size


def test_repeated_or_negative_keys_are_refused():
    with pytest.raises(InputError, match="repeats an expert"):
        simulate(np.array([[3, 3, 5, 7]]), 2)
    with pytest.raises(InputError, match="outside"):
        simulate(np.array([[-1, 2]]), 2)


def test_one_budget_rule_for_the_engine_and_bench_big():
    """`budget_capacity`: slots the bytes hold, less k staging slots per pool, per layer or over one global pool,
    at most E; below 1 when too small (the caller's error)."""
    from expertcache.telemetry.cachesim import budget_capacity

    slot = 1000
    assert budget_capacity(4 * 5 * slot + 999, slot, 4, 2, 8) == 3  # 20 slots, 5 per layer, 2 staging
    assert budget_capacity(4 * 5 * slot, slot, 4, 2, 8, "global") == 4  # (20 - 2) // 4
    assert budget_capacity(10**9, slot, 4, 2, 8) == 8  # at most E
    assert budget_capacity(4 * 2 * slot, slot, 4, 2, 8) == 0  # nothing left beside the staging slots
    assert budget_capacity(-5 * slot, slot, 4, 2, 8) < 1  # a budget the non-expert weights already exceed

