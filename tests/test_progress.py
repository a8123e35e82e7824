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


def test_a_result_names_its_commit_and_says_when_the_code_differs(tmp_path):
    """`git_commit` in a benchmark's JSON: the short HEAD, "+dirty" when tracked code differs from it, but not for
    results, docs or markdown (a benchmark writes its own results file into the checkout)."""
    import subprocess

    from expertcache.runtime.commands import _git_commit

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    assert _git_commit(tmp_path) == ""  # not a checkout
    git("init", "-q")
    (tmp_path / "runtime").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "runtime" / "engine.py").write_text("x = 1\n")
    (tmp_path / "results" / "bench.json").write_text("{}\n")
    (tmp_path / "README.md").write_text("# r\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True,
                          text=True).stdout.strip()
    here = tmp_path / "runtime"
    assert _git_commit(here) == head
    (tmp_path / "results" / "bench.json").write_text('{"a": 1}\n')
    (tmp_path / "README.md").write_text("# r2\n")
    assert _git_commit(here) == head  # a result and the README written: still the commit's code
    from expertcache.telemetry.provenance import provenance, rev_parse

    assert provenance(here) == {"commit": head, "dirty": False} and rev_parse("HEAD", here) == head
    (tmp_path / "runtime" / "engine.py").write_text("x = 2\n")
    assert _git_commit(here) == head + "+dirty"
    assert provenance(here) == {"commit": head, "dirty": True}  # what every script's JSON records
    assert rev_parse("no-such-branch", here) == "" and provenance(tmp_path.parent) == {"commit": None, "dirty": None}


def test_descriptions_are_never_dropped_or_read_as_markup_and_counts_stay_integers():
    out = io.StringIO()
    with Progress(stream=out, every_s=3600) as prog:
        task = prog.add_task("bench big", total=2)
        prog.advance(task)
        prog.update(task, description="bench big: mmap round 1/3: exit -9 [enforce fail at alloc_cpu.cpp:117]")
        prog.advance(task)
        prog.advance(task)  # past the total: no line for each tick
        prog.advance(task)
        prog.update(task, completed=1_234_567)
    lines = out.getvalue().splitlines()
    assert lines[1] == "bench big: mmap round 1/3: exit -9 [enforce fail at alloc_cpu.cpp:117]: 1/2 (0m00s)"
    assert sum(line.endswith("/2 (0m00s)") and ": 2/2" in line for line in lines) == 1
    assert lines[-1].endswith(": 1234567/2 (0m00s)")
    from expertcache.telemetry.progress import _plain

    from rich.text import Text

    text = Text.from_markup(_plain("[/work/bb/x] and [bold]"))  # what rich does with a description
    assert text.plain == "[/work/bb/x] and [bold]"


def test_the_training_bar_of_a_step_bounded_run_names_its_step_limit_not_epoch_minus_2():
    """#46: Lightning's bar read `Epoch 0/-2` on every run (bounded by max_steps: max_epochs is -1)."""
    import lightning as L

    from expertcache.trainer.progress_bar import StepBoundProgressBar

    for kw, want in (({"max_steps": 30}, "Epoch 0 (to step 30)"), ({"max_epochs": 3}, "Epoch 0/2")):
        bar = StepBoundProgressBar()
        trainer = L.Trainer(callbacks=[bar], logger=False, enable_checkpointing=False, accelerator="cpu", **kw)
        bar._trainer = trainer  # set by Lightning's setup hook at fit time
        assert bar._get_train_description(0).strip() == want


def test_a_training_run_in_a_log_writes_timed_step_lines_with_its_losses():
    """Lightning's rich bar writes nothing to a file until the run ends: a pretraining run under nohup showed no
    progress for 45 minutes. In a log, the trainer writes plain lines: step, rate, eta and the bar's metrics."""
    import io

    import lightning as L
    import torch

    from expertcache.trainer.progress_bar import StepLines, training_bar

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def training_step(self, batch, i):
            loss = self.w(batch[0]).pow(2).mean()
            self.log("train/loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, i):
            self.log("val/loss", self.w(batch[0]).pow(2).mean(), prog_bar=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(8, 2)), batch_size=2)
    out = io.StringIO()
    bar = StepLines(every_s=0.0, stream=out)
    trainer = L.Trainer(max_steps=6, val_check_interval=3, check_val_every_n_epoch=None, num_sanity_val_steps=0,
                        limit_val_batches=1, callbacks=[bar], logger=False, enable_checkpointing=False,
                        enable_model_summary=False, accelerator="cpu")
    trainer.fit(Tiny(), train_dataloaders=data, val_dataloaders=data)
    lines = out.getvalue().splitlines()
    assert lines and all(line.startswith("train: step ") for line in lines)
    assert any("train: step 3/6" in line and "val/loss" in line for line in lines)  # after the first validation
    assert "train: step 6/6" in lines[-1] and "train/loss" in lines[-1] and "s/step" in lines[-1]
    assert len(lines) == len(set(lines))  # the end repeats no line (a validation at the last step already wrote it)
    assert "eta" in lines[0]  # before the end the line says how long is left
    assert isinstance(training_bar(), StepLines)  # pytest's captured output is not a terminal
