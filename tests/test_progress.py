"""Progress off a terminal: plain lines in a log, not a bar that shows only at the end."""

import io

import pytest

from expertcache.telemetry.progress import Progress


def test_a_log_gets_lines_while_the_work_runs_and_where_it_stopped():
    out = io.StringIO()
    with Progress(stream=out, every_s=3600) as prog:
        task = prog.add_task("bench big: runs", total=4)
        prog.advance(task)
        assert out.getvalue().splitlines() == ["bench big: runs: 1/4 (0m00s)"]  # the first step shows at once
        prog.advance(task)
        prog.advance(task)
        assert len(out.getvalue().splitlines()) == 1  # then at most one line per every_s
        prog.advance(task)  # the last one always shows
    lines = out.getvalue().splitlines()
    assert lines == ["bench big: runs: 1/4 (0m00s)", "bench big: runs: 4/4 (0m00s)"]  # and not twice at exit


def test_an_open_ended_task_and_a_failure_still_leave_the_count():
    out = io.StringIO()
    with pytest.raises(RuntimeError):
        with Progress(stream=out, every_s=3600) as prog:
            task = prog.add_task("quantize", total=None)
            for _ in range(5):
                prog.advance(task)
            raise RuntimeError("disk full")
    assert out.getvalue().splitlines()[-1] == "quantize: 5 (0m00s)"


def test_every_s_zero_writes_every_step_and_update_renames():
    out = io.StringIO()
    with Progress(stream=out, every_s=0) as prog:
        task = prog.add_task("a", total=2)
        prog.advance(task)
        prog.update(task, description="b", advance=1)
    assert out.getvalue().splitlines() == ["a: 1/2 (0m00s)", "b: 2/2 (0m00s)"]


def test_work_refused_before_its_first_step_writes_no_line():
    out = io.StringIO()
    with pytest.raises(ValueError):
        with Progress(stream=out) as prog:
            prog.add_task("MoE layers quantized", total=None)
            raise ValueError("--bits 3: expected 8 or 4")
    assert out.getvalue() == ""
