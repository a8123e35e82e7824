"""The engine's load threads: a pool whose queued loads run in the order their layers will need them.

A plain thread pool runs loads first come, first served, so a demand load (the layer running now waits for it)
could sit behind prefetches for layers further on, and a prefetch for the next layer behind one issued earlier for
a layer after it: prefetching would then cost. Here each load carries a priority, lowest first (first come, first
served among equals): demand loads `URGENT`, a prefetch the position of the layer it is for, counted across
forward passes, so nearer layers go first. A queued load can still be cancelled (`Future.cancel()`): it never
starts, and never writes its slot.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future

URGENT = float("-inf")


class LoadQueue:
    """`submit(fn, *args, priority=URGENT) -> Future`, `shutdown(wait=True)`: what the engine used of
    `ThreadPoolExecutor`, with priorities."""

    def __init__(self, max_workers: int, thread_name_prefix: str = "expert-load"):
        self._max_workers = max(1, max_workers)  # what measure_bandwidth reads of an executor
        self._heap: list = []
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{thread_name_prefix}_{i}", daemon=True)
                         for i in range(max(1, max_workers))]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args, priority: float = URGENT) -> Future:
        f = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot schedule a load after shutdown")
            heapq.heappush(self._heap, (priority, next(self._seq), f, fn, args))
            self._cv.notify()
        return f

    def queued(self) -> int:
        with self._cv:
            return len(self._heap)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait()
                if not self._heap:  # closed and drained
                    return
                _, _, f, fn, args = heapq.heappop(self._heap)
            if not f.set_running_or_notify_cancel():  # cancelled while queued: never runs
                continue
            try:
                r = fn(*args)
            except BaseException as e:  # noqa: BLE001 - raised where the result is read
                f.set_exception(e)
            else:
                f.set_result(r)

    def shutdown(self, wait: bool = True) -> None:
        """No new loads; the queued ones still run (or are cancelled by their owner); `wait`: until all are done."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()
