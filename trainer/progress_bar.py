"""The training bar: Lightning's rich bar on a terminal, without `Epoch 0/-2` when the run is bounded by steps (#46);
timed plain lines when the output is a log."""

from __future__ import annotations

import time

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar


class StepBoundProgressBar(RichProgressBar):
    """Lightning writes `Epoch E/max_epochs-1`; a run bounded by `max_steps` has max_epochs -1 ("no limit"), which
    printed as `Epoch 0/-2`. Then the bar says the step limit instead."""

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 1:
            return super()._get_train_description(current_epoch)
        text = f"Epoch {current_epoch} (to step {self.trainer.max_steps})" if self.trainer.max_steps > 0 \
            else f"Epoch {current_epoch}"
        return f"{text:{len(self.validation_description)}}" if len(self.validation_description) > len(text) else text


class StepLines(ProgressBar):
    """The training bar for a log: Lightning's rich bar prints nothing until the run ends when its output is a file
    (`nohup expertcache pretrain ... > log 2>&1 &`), so a run in the background showed no progress for 45 minutes.
    This writes one line to standard error at most every `every_s` seconds, after each validation and at the end:

        train: step 150/900, 2.61 s/step, eta 32m36s: train/loss 4.12, val/loss 4.30 (6m31s)
    """

    def __init__(self, every_s: float = 30.0, stream=None):
        super().__init__()
        self.every_s = every_s
        self._stream = stream
        self._enabled = True
        self._t0 = self._last = None
        self._step0 = 0
        self._written_step = None  # the step the last line showed

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def _write(self, trainer, pl_module) -> None:
        import sys

        from expertcache.telemetry.progress import _clock

        now = time.monotonic()
        self._last = now
        step, total = trainer.global_step, trainer.max_steps
        self._written_step = step
        done = step - self._step0
        rate = (now - self._t0) / done if done > 0 else None
        head = f"train: step {step}/{total}" if total and total > 0 else f"train: step {step}"
        if rate is not None:
            head += f", {rate:.2f} s/step"
            if total and total > step:
                head += f", eta {_clock(rate * (total - step))}"
        metrics = {k: v for k, v in self.get_metrics(trainer, pl_module).items() if k != "v_num"}
        shown = ", ".join(f"{k} {float(v):.4g}" if isinstance(v, (int, float)) else f"{k} {v}"
                          for k, v in sorted(metrics.items()))
        line = f"{head}: {shown} ({_clock(now - self._t0)})" if shown else f"{head} ({_clock(now - self._t0)})"
        print(line, file=self._stream if self._stream is not None else sys.stderr, flush=True)

    def on_train_start(self, trainer, pl_module) -> None:
        self._t0 = self._last = time.monotonic()
        self._step0 = trainer.global_step  # a resumed run's rate counts the steps it ran itself

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._enabled and trainer.is_global_zero and time.monotonic() - self._last >= self.every_s:
            self._write(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._enabled and trainer.is_global_zero and self._t0 is not None and not trainer.sanity_checking:
            self._write(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:  # (unless a validation at the last step just wrote it)
        if self._enabled and trainer.is_global_zero and self._t0 is not None and \
                self._written_step != trainer.global_step:
            self._write(trainer, pl_module)


def training_bar() -> ProgressBar:
    """Rich's bar on a terminal, timed lines in a log (standard output or error redirected)."""
    import sys

    tty = sys.stdout.isatty() and sys.stderr.isatty()
    return StepBoundProgressBar() if tty else StepLines()
