"""Compiled inner loops of the cache simulator (numba): the hot path of `cachesim.simulate`.

Each kernel replays one policy of the one cache state machine (`telemetry.cache.CacheState`, token semantics) or
of the published reference semantics over a whole trace with array state, and returns the hit count. They exist
for speed only: `tests/test_cachesim.py` drives `CacheState` and these kernels over the same random traces and
asserts equal hits for every policy, capacity (C < k included) and budget, so the state machine stays the one
definition of what each policy does.

Keys are ints in `[0, n_keys)`; a row of `steps [S, k]` holds distinct keys (a token's experts at one layer).
Recency is a stamp per key: `step * 2k + position` for a key the step kept, so a step's keys rank after every
older key and among themselves in step order, exactly as `CacheState`'s ordered dict after `retain`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_NEVER = np.int64(1) << np.int64(60)


# --- a lazy min-heap of int64 triples (a, b, c), compared lexicographically -------------------------------------

@njit(cache=True, inline="always")
def _less(h, i, j):
    if h[i, 0] != h[j, 0]:
        return h[i, 0] < h[j, 0]
    if h[i, 1] != h[j, 1]:
        return h[i, 1] < h[j, 1]
    return h[i, 2] < h[j, 2]


@njit(cache=True)
def _swap(h, i, j):
    for c in range(3):
        t = h[i, c]
        h[i, c] = h[j, c]
        h[j, c] = t


@njit(cache=True)
def _push(h, n, a, b, c):
    h[n, 0] = a
    h[n, 1] = b
    h[n, 2] = c
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if _less(h, i, p):
            _swap(h, i, p)
            i = p
        else:
            break
    return n + 1


@njit(cache=True)
def _pop(h, n):
    """Remove the minimum (it is copied to row n-1 before the call returns n-1)."""
    n -= 1
    _swap(h, 0, n)
    i = 0
    while True:
        lft = 2 * i + 1
        if lft >= n:
            break
        m = lft
        if lft + 1 < n and _less(h, lft + 1, lft):
            m = lft + 1
        if _less(h, m, i):
            _swap(h, m, i)
            i = m
        else:
            break
    return n


# --- token semantics (CacheState) ----------------------------------------------------------------------------

@njit(cache=True)
def lru_token(rows, cap, n_keys):
    """CacheState(cap, k, "lru") driven over `rows`: hits. A doubly linked list in recency order (head = least
    recent); a step's kept keys go to the tail in step order, then the head is evicted down to `cap`."""
    s_n, k = rows.shape
    nil = n_keys
    nxt = np.full(n_keys + 1, nil, np.int64)
    prv = np.full(n_keys + 1, nil, np.int64)
    res = np.zeros(n_keys, np.bool_)
    size = 0
    hits = 0
    for s in range(s_n):
        n_hit = 0
        for j in range(k):
            if res[rows[s, j]]:
                n_hit += 1
        hits += n_hit
        room = cap - n_hit  # the step's misses that can stay, in step order
        for j in range(k):
            e = rows[s, j]
            if res[e]:  # unlink, to append at the tail below
                nxt[prv[e]] = nxt[e]
                prv[nxt[e]] = prv[e]
            elif room > 0:
                room -= 1
                res[e] = True
                size += 1
            else:
                continue  # streams through staging
            last = prv[nil]
            nxt[last] = e
            prv[e] = last
            nxt[e] = nil
            prv[nil] = e
        while size > cap:  # the least recent keys the step did not use
            v = nxt[nil]
            nxt[nil] = nxt[v]
            prv[nxt[v]] = nil
            res[v] = False
            size -= 1
    return hits


@njit(cache=True)
def lfu_token(rows, cap, n_keys):
    """CacheState(cap, k, "lfu") driven over `rows`: hits. Eviction takes the least (count, last use, key) among
    the keys the step did not use, from a lazily invalidated heap."""
    s_n, k = rows.shape
    res = np.zeros(n_keys, np.bool_)
    count = np.zeros(n_keys, np.int64)
    last = np.full(n_keys, -1, np.int64)
    h_cap = 4 * (n_keys + k) + 16
    h = np.empty((h_cap, 3), np.int64)
    n = 0
    size = 0
    hits = 0
    for s in range(s_n):
        n_hit = 0
        for j in range(k):
            if res[rows[s, j]]:
                n_hit += 1
        hits += n_hit
        for j in range(k):  # touch: every key of the step, kept or not
            e = rows[s, j]
            count[e] += 1
            last[e] = s
        room = cap - n_hit
        for j in range(k):
            e = rows[s, j]
            if not res[e] and room > 0:
                room -= 1
                res[e] = True
                size += 1
        while size > cap:  # the heap holds the others' current entries (the step's keys' entries are stale)
            n = _pop(h, n)
            v = h[n, 2]
            if res[v] and count[v] == h[n, 0] and last[v] == h[n, 1] and last[v] != s:
                res[v] = False
                size -= 1
        if n + k > h_cap:  # compact: one entry per resident key
            n = 0
            for v in range(n_keys):
                if res[v] and last[v] != s:
                    n = _push(h, n, count[v], last[v], v)
        for j in range(k):
            e = rows[s, j]
            if res[e]:
                n = _push(h, n, count[e], last[e], e)
    return hits


@njit(cache=True)
def next_use(rows, n_keys):
    """nxt[s, j]: the next step after s that uses rows[s, j] (`_NEVER` if none)."""
    s_n, k = rows.shape
    seen = np.full(n_keys, _NEVER, np.int64)
    out = np.empty((s_n, k), np.int64)
    for s in range(s_n - 1, -1, -1):
        for j in range(k):
            out[s, j] = seen[rows[s, j]]
        for j in range(k):
            seen[rows[s, j]] = s
    return out


@njit(cache=True)
def _furthest(h, n, res, nu_of):
    """Drop stale entries; the top then is the resident key used furthest in the future (ties: smallest key).
    Returns the new heap size (the top stays in the heap)."""
    while n > 0:
        v = h[0, 1]
        if res[v] and nu_of[v] == -h[0, 0]:
            return n
        n = _pop(h, n)
    return n


@njit(cache=True)
def belady(rows, cap, n_keys, token):
    """The offline optimum (see `cachesim`'s docstring for both semantics): hits."""
    s_n, k = rows.shape
    nxt = next_use(rows, n_keys)
    res = np.zeros(n_keys, np.bool_)
    nu_of = np.zeros(n_keys, np.int64)
    h_cap = 4 * (n_keys + k) + 16
    h = np.empty((h_cap, 3), np.int64)
    n = 0
    size = 0
    hits = 0
    hit = np.zeros(k, np.bool_)
    for s in range(s_n):
        if n + 2 * k > h_cap:
            n = 0
            for v in range(n_keys):
                if res[v]:
                    n = _push(h, n, -nu_of[v], v, 0)
        if token:
            for j in range(k):
                e = rows[s, j]
                hit[j] = res[e]
                if hit[j]:
                    hits += 1
                    nu_of[e] = nxt[s, j]
                    n = _push(h, n, -nxt[s, j], e, 0)
            for j in range(k):
                e = rows[s, j]
                nu = nxt[s, j]
                if hit[j]:
                    continue  # its entry was refreshed above
                if size >= cap:
                    n = _furthest(h, n, res, nu_of)
                    if n == 0 or -h[0, 0] <= nu:
                        continue  # streams through: keeping it would not pay
                    res[h[0, 1]] = False
                    size -= 1
                res[e] = True
                size += 1
                nu_of[e] = nu
                n = _push(h, n, -nu, e, 0)
        else:
            for j in range(k):
                e = rows[s, j]
                if res[e]:
                    nu_of[e] = nxt[s, j]
                    n = _push(h, n, -nxt[s, j], e, 0)
            for j in range(k):
                e = rows[s, j]
                if res[e]:
                    hits += 1
                    continue
                if size >= cap:
                    n = _furthest(h, n, res, nu_of)
                    res[h[0, 1]] = False
                    size -= 1
                res[e] = True
                size += 1
                nu_of[e] = nxt[s, j]
                n = _push(h, n, -nxt[s, j], e, 0)
    return hits


# --- the reference semantics (a step's keys accessed one after another) ----------------------------------------

@njit(cache=True)
def lru_reference(rows, cap, n_keys):
    s_n, k = rows.shape
    res = np.zeros(n_keys, np.bool_)
    when = np.full(n_keys, -1, np.int64)
    h_cap = 4 * (n_keys + k) + 16
    h = np.empty((h_cap, 3), np.int64)
    n = 0
    size = 0
    hits = 0
    for s in range(s_n):
        if n + k > h_cap:
            n = 0
            for v in range(n_keys):
                if res[v]:
                    n = _push(h, n, when[v], v, 0)
        for j in range(k):
            e = rows[s, j]
            if res[e]:
                hits += 1
                if when[e] == s:
                    continue
            elif size >= cap:
                while True:  # the least recent, ties to the smallest key
                    n = _pop(h, n)
                    v = h[n, 1]
                    if res[v] and when[v] == h[n, 0]:
                        res[v] = False
                        size -= 1
                        break
            if not res[e]:
                res[e] = True
                size += 1
            when[e] = s
            n = _push(h, n, s, e, 0)
    return hits


@njit(cache=True)
def lfu_reference(rows, cap, n_keys):
    s_n, k = rows.shape
    res = np.zeros(n_keys, np.bool_)
    count = np.zeros(n_keys, np.int64)
    last = np.full(n_keys, -1, np.int64)
    h_cap = 4 * (n_keys + k) + 16
    h = np.empty((h_cap, 3), np.int64)
    n = 0
    size = 0
    hits = 0
    for s in range(s_n):
        if n + k > h_cap:
            n = 0
            for v in range(n_keys):
                if res[v]:
                    n = _push(h, n, count[v], last[v], v)
        for j in range(k):
            e = rows[s, j]
            count[e] += 1
            last[e] = s
            if res[e]:
                hits += 1
                n = _push(h, n, count[e], last[e], e)
                continue
            if size >= cap:
                while True:  # min (count, last, key) among the cached keys
                    n = _pop(h, n)
                    v = h[n, 2]
                    if res[v] and count[v] == h[n, 0] and last[v] == h[n, 1]:
                        res[v] = False
                        size -= 1
                        break
            res[e] = True
            size += 1
            n = _push(h, n, count[e], last[e], e)
    return hits


# --- the scored policy (a predictor's or a learned policy's keep scores) ---------------------------------------

@njit(cache=True, inline="always")
def _score(keep, prev, t, i, j, e):
    """Score of expert e of block j at step (token t, block i): block j was last scored at token t if j <= i,
    else at t - 1 (`prev` at the chunk's first token)."""
    if j <= i:
        return keep[t, j, e]
    if t > 0:
        return keep[t - 1, j, e]
    return prev[j, e]


@njit(cache=True)
def _block_min(keep, prev, t, i, j, n_e, res, rank):
    """The resident key of block j with the least (score, rank); -1 if none."""
    best = -1
    bs = 0.0
    br = 0
    for e in range(n_e):
        key = j * n_e + e
        if res[key]:
            sc = _score(keep, prev, t, i, j, e)
            if best < 0 or sc < bs or (sc == bs and rank[key] < br):
                best, bs, br = key, sc, rank[key]
    return best


@njit(cache=True)
def scored_chunk(ids, keep, prev, cap, res, rank, state):
    """The scored policy (CacheState "scored", token semantics) over a chunk of tokens, state carried between
    chunks: after each step the cache keeps the `cap` keys of (resident ∪ step) with the highest scores, ties to
    the more recent. One cache over the blocks of `ids [B, T, k]` (B = 1: a per-layer cache; B = layers: a global
    budget, keys `block * E + expert`, steps token-major), `keep [T, B, E]` the scores each block's step leaves
    (float64), `prev [B, E]` the scores before the chunk. `res [B*E]` bool and `rank [B*E]` int64 are the cache;
    `state` int64 [size, steps, hits]. Returns nothing; hits accumulate in state[2]."""
    n_b, t_n, k = ids.shape
    n_e = keep.shape[2]
    bmin = np.empty(n_b, np.int64)
    size, step, hits = state[0], state[1], state[2]
    is_new = np.zeros(k, np.bool_)
    for t in range(t_n):
        if t == 0:
            for j in range(n_b):
                bmin[j] = _block_min(keep, prev, 0, -1, j, n_e, res, rank)
        for i in range(n_b):
            base = step * 2 * k
            for j in range(k):
                key = i * n_e + ids[i, t, j]
                if res[key]:
                    hits += 1
                    is_new[j] = False
                    rank[key] = base + j
                else:
                    is_new[j] = True
                    res[key] = True
                    size += 1
                    rank[key] = base + k + j
            bmin[i] = _block_min(keep, prev, t, i, i, n_e, res, rank)
            while size > cap:  # evict the least (score, rank) of every candidate
                bb = -1
                bs = 0.0
                br = 0
                for j in range(n_b):
                    v = bmin[j]
                    if v >= 0:
                        sc = _score(keep, prev, t, i, j, v - j * n_e)
                        if bb < 0 or sc < bs or (sc == bs and rank[v] < br):
                            bb, bs, br = j, sc, rank[v]
                res[bmin[bb]] = False
                size -= 1
                bmin[bb] = _block_min(keep, prev, t, i, bb, n_e, res, rank)
            for j in range(k):  # the step's kept keys, most recent, in step order
                key = i * n_e + ids[i, t, j]
                if res[key]:
                    rank[key] = base + j
            bmin[i] = _block_min(keep, prev, t, i, i, n_e, res, rank)
            step += 1
    state[0], state[1], state[2] = size, step, hits
