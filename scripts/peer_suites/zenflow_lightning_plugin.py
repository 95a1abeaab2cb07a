"""pytest plugin: Lightning's own tests (tests/tests_pytorch) with ZenFlow as the default one-device CPU strategy.

Loaded by ``scripts/peer_suites.sh`` with ``-p zenflow_lightning_plugin`` (this folder on ``PYTHONPATH``); nothing in
Lightning's tree is edited. ``ZENFLOW_PEER_MODE`` picks what it patches:

- ``topk1``: ``ZenFlowStrategy(topk_ratio=1.0, full_warm_up_rounds=0)`` (every column on the device: AdamW's numbers)
- ``topk0``: ``ZenFlowStrategy(topk_ratio=0.0, update_interval=1, overlap_step=False, full_warm_up_rounds=0)`` (every
  column on the host worker, applied at every step: AdamW's numbers)
- ``defaults``: ``ZenFlowStrategy()`` (the shipped knobs: checks behaviour, not numbers)
- ``control``: only the optimizer swap below, Lightning's own strategy (tells a harness effect from a ZenFlow one)

``ZENFLOW_PEER_KNOBS`` (JSON, optional) adds knobs on top of the mode's, e.g. ``{"log_telemetry": false}``.

In every mode but ``control``, ``Trainer(strategy="auto")`` on one CPU device resolves to ``ZenFlowStrategy`` instead
of ``SingleDeviceStrategy`` (a patch of Lightning's accelerator connector); in every mode ``BoringModel`` returns
``torch.optim.AdamW`` (same lr, same ``StepLR``) instead of SGD, which ZenFlow refuses.

Per test it records in the junit XML (``<property>``): ``zenflow=1`` when a Trainer of the test took ZenFlow, and
``leaked_workers=<pids>`` when the test left a ZenFlow host worker (or another spawned child) running; such a child is
killed then, so one leak does not slow the tests after it.
"""

from __future__ import annotations

import json
import os

import pytest

MODE = os.environ.get("ZENFLOW_PEER_MODE", "defaults")
KNOBS = {
    "topk1": {"topk_ratio": 1.0, "full_warm_up_rounds": 0},
    "topk0": {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "full_warm_up_rounds": 0},
    "defaults": {},
    "control": None,
}
if MODE not in KNOBS:
    raise pytest.UsageError(f"ZENFLOW_PEER_MODE={MODE!r} is not one of {sorted(KNOBS)}.")
if KNOBS[MODE] is not None:
    KNOBS[MODE] = {**KNOBS[MODE], **json.loads(os.environ.get("ZENFLOW_PEER_KNOBS") or "{}")}

# The interim moves run eagerly, as in the repository's own suite: compiling them costs seconds per process
os.environ.setdefault("LIGHTNING_ZENFLOW_KERNELS", "eager")

import torch  # noqa: E402
from lightning.pytorch.demos import boring_classes  # noqa: E402
from lightning.pytorch.strategies import SingleDeviceStrategy  # noqa: E402
from lightning.pytorch.trainer.connectors import accelerator_connector  # noqa: E402

from lightning_zenflow import ZenFlowStrategy  # noqa: E402
from lightning_zenflow.engine import spares  # noqa: E402
from lightning_zenflow.engine.spares import reap_children_since, spawned_children  # noqa: E402

_took_zenflow = False


def _adamw_configure_optimizers(self):  # BoringModel's, with AdamW in place of SGD
    optimizer = torch.optim.AdamW(self.parameters(), lr=0.1)
    lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    return [optimizer], [lr_scheduler]


boring_classes.BoringModel.configure_optimizers = _adamw_configure_optimizers

if KNOBS[MODE] is not None:
    _lightning_choose_strategy = accelerator_connector._AcceleratorConnector._choose_strategy

    def _choose_strategy(self):
        global _took_zenflow
        chosen = _lightning_choose_strategy(self)
        if type(chosen) is SingleDeviceStrategy and chosen.root_device.type == "cpu":
            _took_zenflow = True
            return ZenFlowStrategy(**KNOBS[MODE])
        return chosen

    accelerator_connector._AcceleratorConnector._choose_strategy = _choose_strategy

    # Many Trainers, one after another: a closed engine's host worker is kept for the next one and new workers are
    # forked from a fork server, as in the repository's own suite (engine/spares.py); a leak still shows (below).
    if os.environ.get("ZENFLOW_PEER_SPARES", "1") == "1":
        spares.keep_spare_workers(True)
        spares.start_workers_preloaded(True)


_children_before: set[int] = set()


def pytest_runtest_setup(item):
    global _took_zenflow, _children_before
    _took_zenflow = False
    _children_before = spawned_children()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    # after the test's teardown (its fixtures, its Trainer's teardown): the report copies item.user_properties
    if call.when == "teardown":
        if _took_zenflow:
            item.user_properties.append(("zenflow", "1"))
        leaked = reap_children_since(_children_before)
        if leaked:
            item.user_properties.append(("leaked_workers", " ".join(map(str, leaked))))
    return (yield)


def pytest_report_header(config):
    return f"zenflow peer suite: mode={MODE} knobs={KNOBS[MODE]}"
