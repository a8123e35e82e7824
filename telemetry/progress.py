"""Progress for long commands, on a terminal and in a log.

`rich.progress.Progress` draws a live bar on a terminal, but when its output is a file (`nohup ... > log 2>&1 &`, a
CI job, a pipe) it prints nothing until the work ends: a log of a 15-minute `bench big` stayed empty until the last
second. `Progress` here takes the same calls (`add_task`, `advance`, `update`); on a terminal it is rich's bar (on
standard error: standard output stays a command's JSON), elsewhere it writes one plain line per task to standard
error at most every `every_s` seconds, and one where the task stopped:

    bench big: expertcache:on-demand round 1/3: 0.196 s/token: 1 (0m30s)
"""

from __future__ import annotations

import sys
import time


def _plain(text: str) -> str:
    """`text` as rich shows it literally (its `[...]` not read as markup: a path or an error message would raise
    `MarkupError` or vanish as a style tag)."""
    from rich.markup import escape

    return escape(text)


def _clock(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _PlainTask:
    def __init__(self, description: str, total):
        self.description, self.total, self.completed = description, total, 0
        self.t0 = time.monotonic()
        self.last = None  # monotonic time of the last line written
        self.shown = None  # `completed` as that line showed it
        self.shown_description = description

    def line(self) -> str:
        done = _count(self.completed) if self.total is None else f"{_count(self.completed)}/{_count(self.total)}"
        return f"{self.description}: {done} ({_clock(time.monotonic() - self.t0)})"


def _count(x) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.1f}"  # 1234567, not 1.23457e+06


class Progress:
    """`rich.progress.Progress` on a terminal; plain timed lines elsewhere (`every_s`: the least seconds between two
    lines of one task; `stream`: where they go, standard error by default)."""

    def __init__(self, *columns, transient: bool = False, every_s: float = 10.0, stream=None, **kw):
        self._stream = stream if stream is not None else sys.stderr
        tty = getattr(self._stream, "isatty", lambda: False)()
        if tty and stream is None:
            from rich.console import Console
            from rich.progress import Progress as Rich

            kw.setdefault("console", Console(stderr=True))  # standard output stays the command's JSON
            self._rich = Rich(*columns, transient=transient, **kw)
        else:
            self._rich = None
        self._tasks: list[_PlainTask] = []
        self.every_s = every_s

    # the context manager and the three calls the commands use
    def __enter__(self) -> "Progress":
        if self._rich is not None:
            self._rich.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._rich is not None:
            self._rich.__exit__(*exc)
            return
        for t in self._tasks:  # where each task stopped (also when the work failed), unless its last line says so
            if t.completed and t.shown != t.completed:  # (nothing for work refused before its first step)
                self._write(t)

    def add_task(self, description: str, total=None, **kw) -> int:
        if self._rich is not None:  # descriptions carry paths and error text: shown as written, never as markup
            return self._rich.add_task(_plain(description), total=total, **kw)
        self._tasks.append(_PlainTask(description, total))
        return len(self._tasks) - 1

    def advance(self, task: int, advance: float = 1) -> None:
        if self._rich is not None:
            self._rich.advance(task, advance)
            return
        t = self._tasks[task]
        t.completed += advance
        self._maybe(t)

    def update(self, task: int, total=None, completed=None, advance=None, description=None, **kw) -> None:
        if self._rich is not None:
            self._rich.update(task, total=total, completed=completed, advance=advance,
                              description=None if description is None else _plain(description), **kw)
            return
        t = self._tasks[task]
        if total is not None:
            t.total = total
        if completed is not None:
            t.completed = completed
        if advance is not None:
            t.completed += advance
        if description is not None:
            t.description = description
        self._maybe(t)

    def _maybe(self, t: _PlainTask) -> None:
        now = time.monotonic()
        at_total = t.total is not None and t.completed >= t.total and not (t.shown is not None and t.shown >= t.total)
        if t.last is None or now - t.last >= self.every_s or at_total or t.description != t.shown_description:
            self._write(t)  # (a new description says what just happened: never dropped)

    def _write(self, t: _PlainTask) -> None:
        t.last, t.shown, t.shown_description = time.monotonic(), t.completed, t.description
        try:
            print(t.line(), file=self._stream, flush=True)
        except (OSError, ValueError):  # a closed or broken stream never stops the work
            pass
