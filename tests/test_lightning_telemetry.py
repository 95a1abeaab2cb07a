"""ZenFlow telemetry through Lightning's loggers, the progress bar and the end-of-fit summary (CPU)."""

from __future__ import annotations

import csv
import logging
import pathlib

import lightning
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning_helpers import TinyModule, fit, make_trainer

from lightning_zenflow import ZenFlowStrategy, ZenFlowTelemetry

pytestmark = pytest.mark.usefixtures("no_leaked_children")

PER_STEP = ("stall_ms", "update_interval", "d2h_bytes", "h2d_bytes", "host_bytes", "device_bytes")


def _metrics(log_dir: pathlib.Path) -> list[dict[str, str]]:
    with open(next(log_dir.rglob("metrics.csv"))) as metrics_file:
        return list(csv.DictReader(metrics_file))


def _column(rows: list[dict[str, str]], name: str) -> list[float]:
    return [float(row[name]) for row in rows if row.get(name)]


def test_metrics_progress_bar_and_summary(tmp_path: pathlib.Path, caplog: pytest.LogCaptureFixture) -> None:
    strategy = ZenFlowStrategy(
        full_warm_up_rounds=0, topk_ratio=0.25, update_interval=2, select_strategy="step", select_interval=4
    )
    with caplog.at_level(logging.INFO):
        _, trainer = fit(strategy, logger=CSVLogger(tmp_path, name="zf"), log_every_n_steps=1)
    rows = _metrics(tmp_path / "zf")
    for name in PER_STEP:
        assert len(_column(rows, f"zenflow/{name}")) == 16, name
    assert [int(row["step"]) for row in rows if row.get("zenflow/stall_ms")] == list(range(16)), "one row per step"
    assert set(_column(rows, "zenflow/update_interval")) == {2.0}
    assert max(_column(rows, "zenflow/d2h_bytes")) > 0
    assert max(_column(rows, "zenflow/h2d_bytes")) > 0
    assert min(_column(rows, "zenflow/host_bytes")) > 0
    assert min(_column(rows, "zenflow/device_bytes")) > 0
    # the first selection (optimizer step 1), then a refresh at the first window end at least 4 steps after the
    # last selection: steps 6, 10, 14. Lightning's x-axis for optimizer step t is t - 1.
    captured = _column(rows, "zenflow/selection_captured")
    overlap = _column(rows, "zenflow/selection_overlap")
    assert [int(row["step"]) for row in rows if row.get("zenflow/selection_captured")] == [0, 5, 9, 13]
    assert [int(row["step"]) for row in rows if row.get("zenflow/selection_overlap")] == [5, 9, 13]
    assert all(0.0 <= value <= 1.0 for value in captured + overlap)
    # the progress bar shows the stall share of the last step in percent; the logger keeps the fraction
    last_share = _column(rows, "zenflow/stall_share")[-1]
    assert trainer.progress_bar_metrics["stall%"] == pytest.approx(100 * last_share, rel=1e-4, abs=1e-6)
    summaries = [record.getMessage() for record in caplog.records if "ZenFlow run summary" in record.getMessage()]
    assert len(summaries) == 1
    assert "16 optimizer steps" in summaries[0]
    assert "stall share" in summaries[0]


class _OwnCallbacks(Callback):
    def __init__(self) -> None:
        self.telemetry: list[Callback] = []

    def on_train_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule) -> None:
        self.telemetry = [c for c in trainer.callbacks if isinstance(c, ZenFlowTelemetry)]


def test_log_telemetry_false_adds_no_callback(tmp_path: pathlib.Path) -> None:
    own = _OwnCallbacks()
    _, trainer = fit(
        ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=1.0, log_telemetry=False),
        logger=CSVLogger(tmp_path, name="off"),
        log_every_n_steps=1,
        callbacks=[own],
    )
    assert own.telemetry == []
    assert not any(key.startswith("zenflow/") for key in _metrics(tmp_path / "off")[0])
    assert "stall%" not in trainer.progress_bar_metrics


def test_a_user_telemetry_callback_is_not_doubled() -> None:
    own, mine = _OwnCallbacks(), ZenFlowTelemetry(print_summary=False)
    fit(ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=1.0), max_epochs=1, callbacks=[own, mine])
    assert own.telemetry == [mine]
    assert mine.summary.steps == 8


def test_telemetry_logs_with_a_training_step_on_the_dataloader_iterator() -> None:
    """``training_step(self, dataloader_iter)`` gives Lightning no batch to take a size from: the telemetry's own
    per-step figure names its size, so the fit runs."""

    class IteratorStep(TinyModule):
        def training_step(self, dataloader_iter):  # noqa: ANN001, ANN201
            batch, _, _ = next(dataloader_iter)
            return self._loss(batch)

    trainer = make_trainer(ZenFlowStrategy(topk_ratio=0.25, update_interval=2), max_steps=6)
    trainer.fit(IteratorStep())
    assert trainer.global_step == 6
    assert "stall%" in trainer.progress_bar_metrics
