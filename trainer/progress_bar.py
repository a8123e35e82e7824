"""The training bar: Lightning's rich bar, without `Epoch 0/-2` when the run is bounded by steps (#46)."""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


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
