"""pytest plugin: PyTorch's OptimizerInfo suite (test/test_optim.py) on ``ZenFlowAdamW``, beside ``torch.optim.AdamW``.

Loaded by ``scripts/peer_suites.sh`` with ``-p zenflow_torch_optim`` (this folder on ``PYTHONPATH``) before
test_optim.py is imported: its ``@optims(optim_db)`` decorators read ``optim_db`` at import, so the entry appended here
becomes one more optimizer of every test, named after its class (``..._ZenFlowAdamW<Mode>_cpu_float32``); the script
selects those with ``-k ZenFlowAdamW``.

``ZENFLOW_PEER_MODE`` picks the knobs the subclass presets in ``__init__`` (the only override ZenFlowAdamW allows):
``topk1`` and ``topk0`` are the two settings whose numbers equal AdamW's, ``defaults`` the shipped knobs.

The entry is AdamW's (``optim_inputs_func``, ``optim_error_inputs_func``, ``scheduler_inputs``, decorators, skips),
less what ZenFlowAdamW documents that it refuses, so that a test reaches the numbers instead of stopping at the first
refused input: no ``differentiable`` variant in ``supported_impls`` (the ``foreach`` and ``fused`` ones stay: they are
accepted and change nothing), ``has_capturable_arg=False``, and the inputs with ``amsgrad=True`` or
``capturable=True`` dropped. With ``ZENFLOW_PEER_TORCH_VERBATIM=1`` the entry is AdamW's unchanged (every refusal
then fails its test).

test_optim.py also imports ``TestLRScheduler``, ``TestDifferentiableOptimizer`` and ``TestSWAUtils`` from
PyTorch's ``test/optim/`` folder, which tests nothing of an optimizer's own: empty stand-ins are installed for them
when that folder is not beside the file.

Leaks: the tests never call ``close()``. After each test the plugin records (junit ``<property>``) how many
ZenFlowAdamW instances it built and how many still had a live engine (``unclosed_engines``: their host worker runs
until ``close()`` or interpreter exit, as documented), then closes them, and records any spawned child still running
after that (``leaked_workers``): a real leak.
"""

from __future__ import annotations

import copy
import os
import sys
import types
import weakref

import pytest

MODE = os.environ.get("ZENFLOW_PEER_MODE", "defaults")
KNOBS = {
    "topk1": {"topk_ratio": 1.0, "full_warm_up_rounds": 0},
    "topk0": {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "full_warm_up_rounds": 0},
    "defaults": {},
}
if MODE not in KNOBS:
    raise pytest.UsageError(f"ZENFLOW_PEER_MODE={MODE!r} is not one of {sorted(KNOBS)}.")
VERBATIM = os.environ.get("ZENFLOW_PEER_TORCH_VERBATIM", "0") == "1"

os.environ.setdefault("LIGHTNING_ZENFLOW_KERNELS", "eager")  # as in the repository's suite: no torch.compile

from torch.testing._internal import common_optimizers  # noqa: E402

from lightning_zenflow import ZenFlowAdamW  # noqa: E402
from lightning_zenflow.engine import spares  # noqa: E402
from lightning_zenflow.engine.spares import reap_children_since, spawned_children  # noqa: E402
from lightning_zenflow.optim import TORCH_OPTIONS  # noqa: E402

_built: list[weakref.ref] = []


class _Preset(ZenFlowAdamW):
    """ZenFlowAdamW with the mode's knobs preset (a keyword given by the test still wins)."""

    def __init__(self, params, *args, **kwargs):
        super().__init__(params, *args, **{**KNOBS[MODE], **kwargs})
        _built.append(weakref.ref(self))


_CLASS_NAME = {"topk1": "ZenFlowAdamWTopk1", "topk0": "ZenFlowAdamWTopk0", "defaults": "ZenFlowAdamWDefaults"}[MODE]
Preset = type(_CLASS_NAME, (_Preset,), {"__module__": __name__})


def _accepted(optim_input) -> bool:
    return all(optim_input.kwargs.get(name, accepted[0]) in accepted for name, (accepted, _) in TORCH_OPTIONS.items())


def _zenflow_entry() -> common_optimizers.OptimizerInfo:
    adamw = next(info for info in common_optimizers.optim_db if info.optim_cls.__name__ == "AdamW")
    entry = copy.copy(adamw)
    entry.optim_cls = Preset
    if not VERBATIM:
        adamw_inputs = adamw.optim_inputs_func

        def optim_inputs_func(device, dtype=None):
            return [optim_input for optim_input in adamw_inputs(device, dtype) if _accepted(optim_input)]

        entry.optim_inputs_func = optim_inputs_func
        # foreach and fused are accepted (no effect: the same numbers); differentiable=True is refused
        entry.supported_impls = tuple(impl for impl in adamw.supported_impls if impl != "differentiable")
        entry.has_capturable_arg = False
    return entry


common_optimizers.optim_db.append(_zenflow_entry())

# the imports of test_optim.py from PyTorch's test/optim/ folder (see the module docstring)
for _name, _classes in {
    "optim.test_lrscheduler": ("TestLRScheduler",),
    "optim.test_optim": ("TestDifferentiableOptimizer",),
    "optim.test_swa_utils": ("TestSWAUtils",),
}.items():
    try:
        __import__(_name)
    except ImportError:
        sys.modules.setdefault("optim", types.ModuleType("optim"))
        module = types.ModuleType(_name)
        for _class in _classes:
            setattr(module, _class, type(_class, (), {"__module__": _name}))
        sys.modules[_name] = module

# many optimizers, one after another: closed engines' workers are kept for the next one, new ones forked from a fork
# server (engine/spares.py), as in the repository's own suite
if os.environ.get("ZENFLOW_PEER_SPARES", "1") == "1":
    spares.keep_spare_workers(True)
    spares.start_workers_preloaded(True)


_children_before: set[int] = set()


def pytest_runtest_setup(item):
    global _children_before
    _built.clear()
    _children_before = spawned_children()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown":
        optimizers = [ref() for ref in _built]
        live = [opt for opt in optimizers if opt is not None and opt.engine is not None]
        item.user_properties.append(("zenflow_optimizers", str(len(_built))))
        if live:
            item.user_properties.append(("unclosed_engines", str(len(live))))
        for optimizer in live:
            optimizer.close()
        _built.clear()
        leaked = reap_children_since(_children_before)
        if leaked:
            item.user_properties.append(("leaked_workers", " ".join(map(str, leaked))))
    return (yield)


def pytest_report_header(config):
    return f"zenflow peer suite: mode={MODE} class={_CLASS_NAME} knobs={KNOBS[MODE]} verbatim={VERBATIM}"
