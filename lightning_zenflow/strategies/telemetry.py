"""Telemetry: the engine's per-step record, logged through Lightning's loggers and the progress bar.

Metric names (all under ``zenflow/``): ``stall_ms``, ``device_update_ms``, ``host_update_ms``,
``update_interval``, ``d2h_bytes``, ``h2d_bytes``, ``device_bytes``, ``host_bytes``, and at selection
refreshes ``selection_overlap`` and ``selection_captured``. The progress bar shows ``stall%``: the percentage of
wall time since the start of training that the training loop spent waiting inside the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info

from lightning_zenflow.engine import StepStats

PROGRESS_BAR_KEY = "stall%"
"""The progress bar's entry: the stall share in percent (``stall%=0.128`` is 0.128 % of the time, not 12.8 %)."""


@dataclass
class RunSummary:
    """Totals of a fit, printed at its end."""

    steps: int = 0
    wall_s: float = 0.0
    stall_s: float = 0.0
    final_loss: float | None = None

    @property
    def stall_share(self) -> float:
        return self.stall_s / self.wall_s if self.wall_s > 0 else 0.0


TRAIN_LOSS_KEYS = ("train_loss", "train_loss_step", "train/loss", "loss", "train_loss_epoch")
"""Where modules log their training loss, in the order the summary looks for it."""


class ZenFlowTelemetry(Callback):
    """Logs ZenFlow's per-step telemetry and closes the run with a short summary.

    Added automatically by ``ZenFlowStrategy(log_telemetry=True)`` (the default); add it yourself to
    change ``log_every_n_steps``, ``print_summary``, the loss it reports or the reference it compares with. Under
    another strategy it still prints the summary (steps, time, loss), so a baseline run reports like a ZenFlow run.

    The ``zenflow/*`` metrics go straight to ``trainer.loggers`` at the step Lightning logs the batch's own
    metrics at (as ``LearningRateMonitor`` does): through ``LightningModule.log`` a metric logged only at some
    steps, like the refresh diagnostics, would be repeated with its stale value at every later step of the epoch.

    Args:
        log_every_n_steps: log the per-step metrics every this many optimizer steps (refresh diagnostics
            always); ``None`` follows ``Trainer(log_every_n_steps=...)``.
        print_summary: print final loss, time and stall share when training ends.
        loss_key: the logged metric shown as the final loss in the summary (``"val_loss"``: the last validation's);
            ``None`` (the default) takes the training loss where the module logged it (``train_loss``, its ``_step``
            form, ``train/loss``, ``loss``), else the loss the last training step returned.
        reference_loss: a value of ``loss_key`` to compare with, e.g. what plain AdamW reaches on the same job; the
            summary shows it and the relative gap next to the final loss.
        reference_label: how the summary names ``reference_loss``.
        reference_note: a few words after the reference and the gap, e.g. where the reference comes from.
    """

    def __init__(
        self,
        log_every_n_steps: int | None = None,
        print_summary: bool = True,
        loss_key: str | None = None,
        reference_loss: float | None = None,
        reference_label: str = "reference",
        reference_note: str | None = None,
    ) -> None:
        if log_every_n_steps is not None and log_every_n_steps < 1:
            raise ValueError(f"log_every_n_steps={log_every_n_steps} must be >= 1 (or None: the Trainer's).")
        if reference_loss is not None and not reference_loss > 0:
            raise ValueError(f"reference_loss={reference_loss} must be a positive loss (or None: no reference).")
        self.log_every_n_steps = log_every_n_steps
        self.print_summary = print_summary
        self.loss_key = loss_key
        self.reference_loss = reference_loss
        self.reference_label = reference_label
        self.reference_note = reference_note
        self.summary = RunSummary()
        self._started: float | None = None
        self._last_stats: StepStats | None = None
        self._last_output_loss: torch.Tensor | None = None
        self._shown_key: str | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.summary = RunSummary()
        self._started = time.perf_counter()
        self._last_stats = None
        self._last_output_loss = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            self._last_output_loss = loss.detach()  # kept as a tensor: read once, at the end (no sync per step)
        engine = getattr(trainer.strategy, "engine", None)
        if engine is None:  # another strategy: count its optimizer steps for the summary, nothing to log
            self.summary.steps = trainer.global_step
            return
        stats = engine.last_stats
        if stats is None or stats is self._last_stats:
            return  # an accumulating micro-batch (or a step skipped for inf gradients): no engine step happened
        self._last_stats = stats
        self.summary.steps += 1
        self.summary.stall_s += stats.stall_s
        self.summary.wall_s = time.perf_counter() - (self._started or time.perf_counter())
        # a CPU tensor: Lightning turns a Python float into a tensor on the module's device, a blocking copy (a
        # host-device sync every step on CUDA); a CPU tensor stays where it is, and so does the progress bar's read
        pl_module.log(
            PROGRESS_BAR_KEY,
            torch.tensor(100 * self.summary.stall_share, dtype=torch.float32),
            prog_bar=True,
            logger=False,
            on_step=True,
            on_epoch=False,
            batch_size=1,  # a per-step figure: no batch to infer a size from (a training_step on a dataloader_iter)
        )
        metrics = {}
        if stats.selection_overlap is not None:
            metrics["zenflow/selection_overlap"] = stats.selection_overlap
        if stats.selection_captured is not None:
            metrics["zenflow/selection_captured"] = stats.selection_captured
        every = self.log_every_n_steps or max(1, trainer.log_every_n_steps)
        if stats.step % every == 0:
            metrics.update(
                {
                    "zenflow/stall_ms": stats.stall_s * 1e3,
                    "zenflow/stall_share": self.summary.stall_share,
                    "zenflow/update_interval": float(stats.update_interval),
                    "zenflow/d2h_bytes": float(stats.d2h_bytes),
                    "zenflow/h2d_bytes": float(stats.h2d_bytes),
                    "zenflow/device_bytes": float(stats.device_bytes),
                    "zenflow/host_bytes": float(stats.host_bytes),
                }
            )
            if stats.device_update_s is not None:
                metrics["zenflow/device_update_ms"] = stats.device_update_s * 1e3
            if stats.host_update_s is not None:
                metrics["zenflow/host_update_ms"] = stats.host_update_s * 1e3
        if metrics and trainer.is_global_zero:
            # the x-axis value Lightning uses for this batch's own metrics (private, as in LearningRateMonitor)
            step = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # not on_fit_end: Lightning tears the strategy down (which removes this callback) before on_fit_end
        if self._started is None:
            return
        self.summary.wall_s = time.perf_counter() - self._started
        key, loss = self._final_loss(trainer)
        self._shown_key = key
        self.summary.final_loss = float(loss) if loss is not None else None
        if self.print_summary:
            rank_zero_info(self.summary_line(zenflow=getattr(trainer.strategy, "engine", None) is not None))

    def _final_loss(self, trainer: pl.Trainer) -> tuple[str | None, Any]:
        metrics = trainer.callback_metrics
        if self.loss_key is not None:
            return self.loss_key, metrics.get(self.loss_key)
        for key in TRAIN_LOSS_KEYS:
            if key in metrics:
                return key, metrics[key]
        if self._last_output_loss is not None:
            return "train_loss (last step)", self._last_output_loss
        return None, None

    def summary_line(self, zenflow: bool = True) -> str:
        """The closing line: optimizer steps, time, the final loss (and its reference), and the stall share."""
        summary = self.summary
        loss_text = f"{summary.final_loss:.4f}" if summary.final_loss is not None else "n/a"
        if self.reference_loss is not None:
            gap = ""
            if summary.final_loss is not None:
                gap = f", {100 * (summary.final_loss / self.reference_loss - 1):+.1f} %"
            note = f", {self.reference_note}" if self.reference_note else ""
            loss_text += f" ({self.reference_label}: {self.reference_loss:.4f}{gap}{note})"
        shown = self._shown_key or self.loss_key or "train_loss"
        line = f"{summary.steps} optimizer steps in {summary.wall_s:.1f} s, final {shown} {loss_text}"
        if not zenflow:
            return f"Run summary: {line}"
        return (
            f"ZenFlow run summary: {line}, stall share {100 * summary.stall_share:.1f} % "
            f"({summary.stall_s:.2f} s waiting on the engine)"
        )
