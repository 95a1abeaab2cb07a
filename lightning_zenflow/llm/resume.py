"""A training DataLoader that a Lightning checkpoint taken mid-epoch resumes where it stopped.

Lightning saves the state of a loader that has ``state_dict``/``load_state_dict`` in the checkpoint and loads it into
the loader before the resumed epoch starts. What the loader itself knows is not the position, though: the training
loop fetches one batch ahead. So the state is read from the loop: the epoch and the number of its batches processed
when the checkpoint was taken. The resumed iteration of that epoch skips them (the order of an epoch is fixed by the
seed and the epoch: :class:`~lightning_zenflow.demo.data.EpochSeededSampler`), so the run continues on the batch the
uninterrupted run would have trained on next; later epochs are whole.

Lightning hands the loader its saved state only when it builds the loader after restoring the checkpoint's loops. A
``configure_optimizers`` that reads ``trainer.estimated_stepping_batches`` (``CausalLMFineTune``'s cosine schedule
does, whenever ``max_epochs`` is set) builds it earlier, during the strategy's setup, and Lightning then keeps the
state unloaded (Lightning issue #20550): the resumed epoch would start over. So the skip is decided at the first fetch
of an iteration, after every restore, and a state Lightning still holds is loaded then.
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
        return _Skipping(super().__iter__(), self._batches_to_skip)

    def _batches_to_skip(self) -> int:
        """How many batches the iteration starting now skips (once): the saved place, in its own epoch."""
        trainer = self.trainer() if self.trainer is not None else None
        if trainer is None:
            return 0
        if self.resume_at is None and trainer.fit_loop.restarting:
            # the loader was built before the restore: the state Lightning keeps for it, if any, is loaded here
            load_pending = getattr(trainer.fit_loop, "_load_combined_loader_states", None)
            if load_pending is not None:
                load_pending()
        resume_at, self.resume_at = self.resume_at, None
        if resume_at is None or trainer.current_epoch != resume_at[0]:
            return 0
        return resume_at[1]


class _Skipping:
    """``iterator`` without its first ``skip()`` items, counted and skipped at the first ``next``: Lightning sets the
    sampler's epoch after it calls ``iter`` and before it fetches (the epoch's order is drawn at the first fetch), and
    restores a checkpoint's loops after the first ``iter`` when the loader was built early."""

    def __init__(self, iterator: Iterator[Any], skip: Callable[[], int]) -> None:
        self.iterator = iterator
        self.skip: Callable[[], int] | None = skip

    def __iter__(self) -> _Skipping:
        return self

    def __next__(self) -> Any:
        if self.skip is not None:
            skip, self.skip = self.skip(), None
            for _ in range(skip):
                next(self.iterator)
        return next(self.iterator)
