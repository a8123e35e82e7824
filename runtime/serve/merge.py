"""A decode step and a prompt chunk in one pass over the experts.

With every expert resident, a forward's cost is mostly reading the experts its tokens chose, once each however many
tokens chose them. A batch's decode step touches a good share of each layer's experts, and so does a prompt chunk
beside it (`serve.useful_chunk`: enough tokens to touch 90% of them), so running them as two forwards reads most
experts twice per turn of the scheduler. `merged` runs the two forwards of the same model at once, each with its
own KV cache, mask and positions, on two threads that take turns (one runs at a time: no more cores than one
forward uses), and they meet at every MoE layer: the second to arrive runs the layer's experts once, for both
inputs' rows together, through the engine (`OffloadEngine.run_layer`: one plan, one set of reads, one count), and
each forward goes on with its own rows. Everything outside the experts (attention, norms, the caches) is each
forward's own, so each gives the logits it gives alone, up to the experts kernels' roundings for the rows they
compute together (a row's output does not depend on the others' values; the kernel chosen by the call's row count
may differ).

    out_a, out_b = merged(engine, lambda: forward_a(), lambda: forward_b())

A forward that ends (or fails) leaves the meeting; the other computes its remaining layers alone.
"""

from __future__ import annotations

import threading

import torch


class Meeting:
    """The rendezvous of two forwards (parties 0 and 1) at each MoE layer, and the baton they pass: a party runs
    only while it holds the turn, and hands it over when it waits at a layer or ends."""

    def __init__(self):
        self.cond = threading.Condition()
        self.turn = 0
        self.active = [True, True]
        self.deposit: list = [None, None]  # a party's (module, hidden, index, weights) waiting at a layer
        self.result: list = [None, None]  # its rows of the merged output, or an exception
        self.local = threading.local()
        self.layers = 0  # MoE layers computed once for both

    def party(self) -> int | None:
        return getattr(self.local, "party", None)

    def wait_turn(self, p: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == p or not self.active[1 - p])
            self.turn = p

    def leave(self, p: int) -> None:
        """Party `p` ended (or failed): the other runs alone from now on."""
        with self.cond:
            self.active[p] = False
            self.turn = 1 - p
            self.cond.notify_all()

    def meet(self, run, mod, hidden, top_k_index, top_k_weights):
        """The MoE layer `mod` for the calling party: computed together with the other party's rows when it waits
        at the same layer (or comes to it), alone when the other has left or the two cannot be joined."""
        p = self.party()
        q = 1 - p
        with self.cond:
            theirs = self.deposit[q]
            if theirs is not None:
                self.deposit[q] = None
                if theirs[0] is mod and _joinable(theirs[1:], (hidden, top_k_index, top_k_weights)):
                    n = theirs[1].shape[0]
                    try:
                        out = run(mod, torch.cat([theirs[1], hidden]), torch.cat([theirs[2], top_k_index]),
                                  torch.cat([theirs[3], top_k_weights]))
                    except BaseException as e:  # noqa: BLE001 - both parties' layer failed: both raise it
                        self.result[q] = e
                        self.cond.notify_all()
                        raise
                    self.layers += 1
                    self.result[q] = out[:n]
                    self.cond.notify_all()  # (it resumes when this party hands over the turn)
                    return out[n:]
                self.result[q] = _Alone  # not the same layer (never for one model): each computes its own
                self.cond.notify_all()
            elif self.active[q]:
                self.deposit[p] = (mod, hidden, top_k_index, top_k_weights)
                self.turn = q
                self.cond.notify_all()
                self.cond.wait_for(lambda: (self.result[p] is not None and self.turn == p) or not self.active[q])
                got, self.result[p] = self.result[p], None
                if got is None:  # the other left without coming to this layer
                    self.deposit[p] = None
                self.turn = p
                if isinstance(got, BaseException):
                    raise got
                if got is not None and got is not _Alone:
                    return got
        return run(mod, hidden, top_k_index, top_k_weights)


class _Alone:  # a party told to compute its own layer
    pass


def _joinable(a, b) -> bool:
    """Whether two (hidden, index, weights) can be one call: the same trailing shapes and dtypes and device."""
    return all(x.dtype == y.dtype and x.device == y.device and x.shape[1:] == y.shape[1:] for x, y in zip(a, b))


def merged(engine, first, second):
    """`(first(), second())`, the two forwards run as one pass over the experts of `engine`'s model (see the
    module's docstring). `first` runs on the calling thread, `second` on a helper thread with the caller's torch
    thread count. An exception in either is raised after both have ended (the first's before the second's);
    `engine.meeting` is set for the duration."""
    m = Meeting()
    out: list = [None, None]
    err: list = [None, None]
    threads = torch.get_num_threads()
    grad = torch.is_grad_enabled()

    def body(p, fn):
        m.local.party = p
        try:
            if p:
                torch.set_num_threads(threads)
                m.wait_turn(p)
            with torch.set_grad_enabled(grad):
                out[p] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            err[p] = e
        finally:
            m.local.party = None
            m.leave(p)

    engine.meeting = m
    t = threading.Thread(target=body, args=(1, second), name="expertcache-merged", daemon=True)
    try:
        t.start()
        body(0, first)
        t.join()
    finally:
        engine.meeting = None
    for e in err:
        if e is not None:
            raise e
    return out[0], out[1], m.layers
