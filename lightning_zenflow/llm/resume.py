"""A training DataLoader that a Lightning checkpoint taken mid-epoch resumes where it stopped.

Lightning saves the state of a loader that has ``state_dict``/``load_state_dict`` in the checkpoint and loads it into
the loader before the resumed epoch starts. What the loader itself knows is not the position, though: the training
loop fetches one batch ahead. So the state is read from the loop: the epoch and the number of its batches processed
when the checkpoint was taken. The resumed iteration of that epoch skips them (the order of an epoch is fixed by the
seed and the epoch: :class:`~lightning_zenflow.demo.data.EpochSeededSampler`), so the run continues on the batch the
uninterrupted run would have trained on next; later epochs are whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import DataLoader


class ResumableLoader(DataLoader):
    """A ``DataLoader`` whose state is its place in the Trainer's current epoch (``trainer`` returns the Trainer, or
    ``None`` outside one: then it saves an empty position and resumes from the start)."""

    def __init__(self, *args: Any, trainer: Callable[[], Any] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.trainer = trainer
        self.resume_at: tuple[int, int] | None = None  # (epoch, batches processed) to skip once

    def state_dict(self) -> dict[str, int]:
        trainer = self.trainer() if self.trainer is not None else None
        if trainer is None:
            return {}
        return {"epoch": trainer.current_epoch, "batches": trainer.fit_loop.epoch_loop.batch_progress.current.processed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.resume_at = (state["epoch"], state["batches"]) if state else None

    def __iter__(self) -> Iterator[Any]:
        iterator = super().__iter__()
        resume_at, self.resume_at = self.resume_at, None
        trainer = self.trainer() if self.trainer is not None else None
        if resume_at is None or trainer is None or trainer.current_epoch != resume_at[0] or resume_at[1] == 0:
            return iterator
        return _Skipping(iterator, resume_at[1])


class _Skipping:
    """``iterator`` without its first ``skip`` items, skipped at the first ``next``: Lightning sets the sampler's epoch
    after it calls ``iter`` and before it fetches, and the epoch's order is drawn at the first fetch."""

    def __init__(self, iterator: Iterator[Any], skip: int) -> None:
        self.iterator = iterator
        self.skip = skip

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        while self.skip:
            self.skip -= 1
            next(self.iterator)
        return next(self.iterator)
