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

@njit(cache=True)
def _block_min(cur, prev, i, j, n_e, res, rank):
    """The resident key of block j with the least (score, rank); -1 if none. Block j's scores at step i are
    `cur[j]` if j <= i (it ran this token), else `prev[j]` (what its last step left)."""
    best = -1
    bs = 0.0
    br = 0
    sc_row = cur[j] if j <= i else prev[j]
    for e in range(n_e):
        key = j * n_e + e
        if res[key]:
            sc = sc_row[e]
            if best < 0 or sc < bs or (sc == bs and rank[key] < br):
                best, bs, br = key, sc, rank[key]
    return best


@njit(cache=True)
def scored_token(ids_t, cur, prev, b_lo, b_hi, cap, res, rank, bmin, state):
    """One token through one scored cache (CacheState "scored", token semantics): the steps of blocks
    b_lo..b_hi-1 in order (one block: a per-layer cache; every block: a global budget, keys `block * E + e`).
    After each step the cache keeps the `cap` keys of (resident ∪ step) with the highest scores, ties to the more
    recent. `ids_t [B, k]` this token's keys per block, `cur`/`prev [B, E]` the scores of this token's steps and
    of the previous token's; `res`/`rank [B*E]`, `bmin [B]` (each block's least resident key, valid for the
    scores its block was last stepped with) and `state` int64 [size, steps, hits] are the cache."""
    k = ids_t.shape[1]
    n_e = cur.shape[1]
    size, step, hits = state[0], state[1], state[2]
    for i in range(b_lo, b_hi):
        base = step * 2 * k
        for j in range(k):
            key = i * n_e + ids_t[i, j]
            if res[key]:
                hits += 1
                rank[key] = base + j
            else:
                res[key] = True
                size += 1
                rank[key] = base + k + j
        bmin[i] = _block_min(cur, prev, i, i, n_e, res, rank)
        while size > cap:  # evict the least (score, rank) of every candidate
            bb = -1
            bs = 0.0
            br = 0
            for j in range(b_lo, b_hi):
                v = bmin[j]
                if v >= 0:
                    sc = cur[j, v - j * n_e] if j <= i else prev[j, v - j * n_e]
                    if bb < 0 or sc < bs or (sc == bs and rank[v] < br):
                        bb, bs, br = j, sc, rank[v]
            res[bmin[bb]] = False
            size -= 1
            bmin[bb] = _block_min(cur, prev, i, bb, n_e, res, rank)
        for j in range(k):  # the step's kept keys, most recent, in step order
            key = i * n_e + ids_t[i, j]
            if res[key]:
                rank[key] = base + j
        bmin[i] = _block_min(cur, prev, i, i, n_e, res, rank)
        step += 1
    state[0], state[1], state[2] = size, step, hits


@njit(cache=True)
def scored_chunk(ids, keep, prev, cap, res, rank, bmin, state):
    """`scored_token` over the tokens of `ids [B, T, k]` with `keep [T, B, E]` (`prev`: the scores before)."""
    n_b = ids.shape[0]
    for t in range(ids.shape[1]):
        scored_token(ids[:, t], keep[t], keep[t - 1] if t > 0 else prev, 0, n_b, cap, res, rank, bmin, state)


@njit(cache=True)
def bank_needed(ids_t, blocks, res, need):
    """Which (block, expert) scores a bank of scored caches can read this token: every key resident in any cache
    now, and this token's keys (a key of a block only enters at that block's step, so nothing else can be read).
    `blocks [C, 2]` each cache's block range; `need [B, E]` is filled."""
    n_b, n_e = need.shape
    need[:, :] = False
    for c in range(blocks.shape[0]):
        for key in range(blocks[c, 0] * n_e, blocks[c, 1] * n_e):
            if res[c, key]:
                need[key // n_e, key % n_e] = True
    for i in range(n_b):
        for j in range(ids_t.shape[1]):
            need[i, ids_t[i, j]] = True


@njit(cache=True)
def bank_token(ids_t, cur, prev, blocks, caps, res, rank, bmin, state):
    """One token through every cache of a bank (`scored_token` each; row c of the state arrays is cache c)."""
    for c in range(blocks.shape[0]):
        scored_token(ids_t, cur, prev, blocks[c, 0], blocks[c, 1], caps[c], res[c], rank[c], bmin[c], state[c])


# --- the learned policy's keep scores (telemetry.learned_policy: features + MLP), every layer of a chunk ---------

@njit(cache=True)
def learned_features(ids_t, probs_t, has_probs, t, cap, alpha, rates, last, gap, count, ema, cooc, cooc_n, cross,
                     cross_n, prev, feats):
    """`learned_policy._step` of every layer for token t: `ids_t [L, k]` (layer l's `up` is layer l-1's ids),
    the state arrays `[L, ...]` (`prev [L, k]`: token t-1's ids) updated, the features written to
    `feats [L, E, F]`. The same float64 arithmetic as `_step`, element by element."""
    n_l, k = ids_t.shape
    n_e = last.shape[1]
    n_r = rates.shape[0]
    used = np.zeros(n_e)
    pr = np.zeros(n_e)
    cs = np.zeros(n_e)
    xs = np.zeros(n_e)
    lp_den = max(1, n_l - 1)
    if t > 0:
        for l in range(n_l):
            for a in range(k):
                pa = prev[l, a]
                for c in range(k):
                    cooc[l, pa, ids_t[l, c]] += 1.0
                cooc_n[l, pa] += 1.0
                if l > 0:
                    pu = prev[l - 1, a]
                    for c in range(k):
                        cross[l, pu, ids_t[l, c]] += 1.0
                    cross_n[l, pu] += 1.0
    for l in range(n_l):
        for c in range(k):
            e = ids_t[l, c]
            if last[l, e] >= 0:
                gap[l, e] = min(t - last[l, e], cap)
            else:
                gap[l, e] = cap
            last[l, e] = t
            count[l, e] += 1.0
        used[:] = 0.0
        pr[:] = 0.0
        for c in range(k):
            e = ids_t[l, c]
            used[e] = 1.0
            if has_probs:
                pr[e] += probs_t[l, c]
            else:
                pr[e] = 1.0 / k
        cs[:] = 0.0
        den = 0.0
        for c in range(k):
            a = ids_t[l, c]
            den += cooc_n[l, a]
            for e in range(n_e):
                cs[e] += cooc[l, a, e]
        den += alpha
        xs[:] = 0.0
        xden = 0.0
        if l > 0:
            for c in range(k):
                a = ids_t[l - 1, c]
                xden += cross_n[l, a]
                for e in range(n_e):
                    xs[e] += cross[l, a, e]
            xden += alpha
        for e in range(n_e):
            for r in range(n_r):
                ema[l, e, r] = ema[l, e, r] * rates[r]
                ema[l, e, r] = ema[l, e, r] + (1.0 - rates[r]) * used[e]
            share = count[l, e] / (t + 1)
            lst = last[l, e]
            rec = min(t - lst, cap) if lst >= 0 else cap
            x = feats[l, e]
            x[0] = used[e]
            x[1] = np.log1p(rec)
            x[2] = 1.0 if lst < 0 else 0.0
            x[3] = np.log1p(gap[l, e])
            for r in range(n_r):
                x[4 + r] = ema[l, e, r]
            j = 4 + n_r
            x[j] = share
            x[j + 1] = (cs[e] + alpha * share) / den
            x[j + 2] = (xs[e] + alpha * share) / xden if l > 0 else share
            x[j + 3] = pr[e]
            x[j + 4] = l / lp_den
    for l in range(n_l):
        for c in range(k):
            prev[l, c] = ids_t[l, c]
