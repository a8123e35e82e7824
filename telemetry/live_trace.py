"""Routing traces of live traffic (`expertcache serve --trace DIR`): every forward the server runs, recorded by the
same router hooks as `trace record`, into rotating Parquet traces that `analyze`, `fit-policy` and
`train-cache-aware` read like any other.

    DIR/trace-000001.parquet            one trace per `rotate_tokens` tokens (prefill and decode), complete once
    DIR/trace-000001.requests.json      renamed into place; its sequence ids -> the requests' ids
    DIR/trace-000002.parquet ...

The decode thread only converts the routers' outputs of each forward to NumPy and hands them over; a writer
thread writes. The hand-over queue is bounded: when the writer falls behind, rows are dropped and counted
(`dropped_tokens`), never waited for, so tracing never holds a request. A server stopped normally finishes its
current file; one that is killed leaves it as a temporary file (never under a final name).
"""

from __future__ import annotations

import queue
import threading
from pathlib import Path

import numpy as np

from .errors import InputError
from .parquet_trace import TraceWriter
from .recorder import Recorder, rows_from_calls


def check_trace_dir(path: str | Path) -> Path:
    """`path` as a folder the server can write traces to (created if missing): an InputError naming it when not."""
    import os
    import tempfile

    from .atomic import own_dir

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise InputError(f"--trace {p} is a file; expected a folder for the rotating traces")
    try:
        own_dir(p, "serve", legacy=_trace_folder)  # a folder of anything but this server's traces is refused
        fd, probe = tempfile.mkstemp(prefix=".expertcache-probe-", dir=p)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise InputError(f"--trace {p}: cannot write there ({e.strerror or e})") from None
    return p


def _trace_folder(p: Path) -> bool:
    """Rotating traces from before output markers: nothing but trace-N.parquet files and their request lists."""
    return all(f.name.startswith("trace-") and f.is_file() for f in p.iterdir())


class LiveTrace:
    def __init__(self, model, out_dir: str | Path, model_id: str, rotate_tokens: int = 50_000,
                 queue_max: int = 1024):
        if rotate_tokens < 1:
            raise InputError(f"trace rotate_tokens={rotate_tokens}; expected >= 1")
        self.dir = check_trace_dir(out_dir)
        self.rotate_tokens = rotate_tokens
        self.rec = Recorder(model).__enter__()
        self.meta = self.rec.meta(model_id, tokenizer=model_id, corpus="", split="",
                                  extra={"source": "expertcache serve --trace", "rotate_tokens": rotate_tokens})
        self.n_layers = len(self.rec.layers)
        self.q: queue.Queue = queue.Queue(maxsize=queue_max)
        # each counter is written by one thread only: handed over and dropped on the way by the decode thread,
        # written and dropped after a write error by the writer
        self.tokens = self.handed_tokens = self._dropped_decode = self._dropped_writer = 0
        self.paths: list[Path] = []
        self.error: str | None = None
        self._next_seq = 0
        self._start = self._first_free_index()
        self.thread = threading.Thread(target=self._write_loop, name="expertcache-trace", daemon=True)
        self.thread.start()

    def _first_free_index(self) -> int:
        taken = [int(p.stem.split("-")[1]) for p in self.dir.glob("trace-*.parquet")
                 if p.stem.split("-")[1].isdigit()]
        return max(taken, default=0) + 1  # a restarted server never overwrites an earlier file

    def seq_id(self, g) -> int:
        sid = getattr(g, "trace_seq", None)
        if sid is None:
            sid = g.trace_seq = self._next_seq
            self._next_seq += 1
        return sid

    def forward_done(self, phase: str, rows: list[tuple[object, np.ndarray, np.ndarray]]) -> None:
        """After one forward of the decode loop: `rows` = (generation, positions, token ids) in the forward's
        token order (batch-major). Converts the routers' outputs and hands them to the writer."""
        calls = self.rec.take()
        if not rows or not calls or not next(iter(calls.values())):
            return
        seq = np.concatenate([np.full(len(p), self.seq_id(g), np.int32) for g, p, _ in rows])
        pos = np.concatenate([np.asarray(p, np.int32) for _, p, _ in rows])
        tok = np.concatenate([np.asarray(t, np.int32) for _, _, t in rows])
        reqs = {self.seq_id(g): getattr(g, "request_id", None) for g, _, _ in rows}
        try:
            out = rows_from_calls(calls, [(seq, pos)], False, False)
        except RuntimeError:  # a forward the hooks saw differently (e.g. an aborted one): not recorded
            self._dropped_decode += len(seq)
            return
        order = np.lexsort((pos, seq))
        out["token"] = np.repeat(tok[order], self.n_layers)
        try:
            self.q.put_nowait((phase, out, reqs, len(seq)))
            self.handed_tokens += len(seq)
        except queue.Full:
            self._dropped_decode += len(seq)

    def _write_loop(self) -> None:
        w, idx, in_file, reqs = None, self._start, 0, {}
        try:
            while True:
                item = self.q.get()
                if item is None:
                    break
                phase, rows, r, n = item
                if w is None:
                    path = self.dir / f"trace-{idx:06d}.parquet"
                    w = TraceWriter(path, self.meta).__enter__()
                w.write(rows["seq_id"], rows["pos"], rows["layer"], phase, "serve", rows["token"], rows["ids"],
                        rows["weights"])
                reqs.update({str(k): v for k, v in r.items()})
                in_file += n
                self.tokens += n
                if in_file >= self.rotate_tokens:
                    self._finish(w, reqs)
                    w, idx, in_file, reqs = None, idx + 1, 0, {}
        except Exception as e:  # noqa: BLE001 - tracing stops; serving goes on (reported in /metrics, /health)
            self.error = f"{type(e).__name__}: {e}"
            if w is not None:
                w.__exit__(type(e), e, None)
                w = None
            while True:  # keep draining so the decode thread never blocks or fills memory
                item = self.q.get()
                if item is None:
                    return
                self._dropped_writer += item[3]
        if w is not None:
            self._finish(w, reqs)

    def _finish(self, w: TraceWriter, reqs: dict) -> None:
        from .atomic import write_json

        w.__exit__(None, None, None)
        write_json(w.path.with_name(w.path.stem + ".requests.json"), {"requests": reqs})
        self.paths.append(w.path)

    @property
    def dropped_tokens(self) -> int:
        return self._dropped_decode + self._dropped_writer

    def describe(self) -> dict:
        """`tokens`: written to trace files; `pending_tokens`: handed to the writer, not yet written (a moment
        after a request ends, its last tokens may still be here); `dropped_tokens`: never recorded."""
        pending = self.handed_tokens - self.tokens - self._dropped_writer
        return {"dir": str(self.dir), "files": len(self.paths), "tokens": self.tokens, "pending_tokens": pending,
                "dropped_tokens": self.dropped_tokens, "rotate_tokens": self.rotate_tokens, "error": self.error}

    def close(self) -> None:
        """Finish the current file (renamed into place) and stop recording."""
        if self.thread.is_alive():
            self.q.put(None)
            self.thread.join(timeout=60)
        self.rec.__exit__(None, None, None)

