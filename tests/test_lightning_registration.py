"""Strategy registration, construction, devices and the errors raised before training (CPU, no or tiny fits)."""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pathlib
import pickle
import subprocess
import sys
import textwrap

import lightning
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_helpers import TinyModule, make_trainer

import lightning_zenflow
from lightning_zenflow import ZenFlowPrecision, ZenFlowStrategy

pytestmark = pytest.mark.usefixtures("no_leaked_children")


# ------------------------------------------------------------------------------------------------- registration


def test_import_registers_zenflow_idempotently() -> None:
    assert "zenflow" in StrategyRegistry
    assert StrategyRegistry["zenflow"]["strategy"] is ZenFlowStrategy
    # a second registration and a re-run of the package's __init__ are no-ops, not "already present" errors
    ZenFlowStrategy.register_strategies(StrategyRegistry)
    importlib.reload(lightning_zenflow)
    assert StrategyRegistry["zenflow"]["strategy"] is ZenFlowStrategy
    assert lightning_zenflow.ZenFlowStrategy is ZenFlowStrategy


def _fresh_interpreter(code: str) -> str:
    """Run ``code`` in a new Python process (nothing imported yet) and return what it printed."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_optimizer_and_the_engine_import_no_lightning_module_and_cost_under_a_second_over_torch() -> None:
    """``from lightning_zenflow import ZenFlowAdamW`` (and ``lightning_zenflow.engine``) in a fresh interpreter: no
    ``lightning`` module and no jsonargparse in ``sys.modules``, and at most 1 s more than ``import torch``."""
    out = _fresh_interpreter(
        """
        import sys, time
        started = time.perf_counter()
        import torch
        torch_s = time.perf_counter() - started
        started = time.perf_counter()
        from lightning_zenflow import ZenFlowAdamW
        import lightning_zenflow.engine
        ours_s = time.perf_counter() - started
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("lightning", "jsonargparse", "pytorch_lightning"))
        print(repr((heavy, torch_s, ours_s)))
        """
    )
    heavy, torch_s, ours_s = eval(out)  # noqa: S307 - our own subprocess's repr
    assert heavy == []
    assert ours_s < 1.0, f"import lightning_zenflow took {ours_s:.2f} s after torch ({torch_s:.2f} s)"


@pytest.mark.parametrize("order", ["zenflow_first", "lightning_first", "submodule_first", "strategy_first"])
def test_import_lightning_zenflow_registers_the_names_whenever_lightning_is_imported(order: str) -> None:
    """``import lightning_zenflow`` in a Lightning program: the Trainer's and Fabric's names work whether Lightning is
    imported before or after it (or only a submodule of it, or first by ``lightning_zenflow.ZenFlowStrategy``), and the
    LightningCLI hint is installed when ``lightning.pytorch.cli`` is; the finder that waited is gone afterwards."""
    imports = {
        "zenflow_first": "import lightning_zenflow\nimport lightning",
        "lightning_first": "import lightning\nimport lightning_zenflow",
        "submodule_first": "import lightning_zenflow\nfrom lightning.pytorch import Trainer\nimport lightning",
        # the first import of Lightning comes from one of this package's strategy modules
        "strategy_first": "from lightning_zenflow import ZenFlowStrategy\nimport lightning",
    }[order]
    out = _fresh_interpreter(
        imports
        + """
import sys
from lightning_zenflow.registration import AfterImport
trainer = lightning.Trainer(strategy="zenflow", accelerator="cpu", devices=1, logger=False)
fsdp = lightning.Trainer(strategy="zenflow_fsdp", accelerator="cpu", devices=1, logger=False)
fabric = lightning.Fabric(strategy="zenflow", accelerator="cpu", devices=1)
names = [type(trainer.strategy).__name__, type(fsdp.strategy).__name__, type(fabric.strategy).__name__]
cli_before = "jsonargparse" in sys.modules
from lightning.pytorch.cli import LightningArgumentParser
hint = getattr(LightningArgumentParser.error, "zenflow_hint", False)
print(repr((names, cli_before, hint, any(isinstance(f, AfterImport) for f in sys.meta_path))))
"""
    )
    names, jsonargparse_before_cli, hint, finder_left = eval(out.strip().splitlines()[-1])  # noqa: S307
    assert names == ["ZenFlowStrategy", "ZenFlowFSDPStrategy", "ZenFlowFabricStrategy"]
    assert not jsonargparse_before_cli, "LightningCLI's parser loads only with LightningCLI"
    assert hint
    assert not finder_left


def test_a_training_script_importing_the_strategy_can_be_rerun_in_the_host_worker(tmp_path: pathlib.Path) -> None:
    # exactly what multiprocessing's spawn does with the parent's __main__ in the child (_fixup_main_from_path),
    # with the environment the host worker is started with
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            from lightning_zenflow import ZenFlowStrategy

            if __name__ == "__main__":
                raise SystemExit("the worker must not run the script's main block")
            """
        )
    )
    from lightning_zenflow.engine.host import WORKER_ENV

    rerun = f"import runpy; runpy.run_path({str(script)!r}, run_name='__mp_main__')"
    result = subprocess.run(
        [sys.executable, "-c", rerun], env={**os.environ, WORKER_ENV: "1"}, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize("name", ["zenflow", "ZenFlow"])
def test_strategy_by_name_gets_a_zenflow_precision_plugin(name: str) -> None:
    trainer = lightning.Trainer(strategy=name, accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, ZenFlowStrategy)
    assert isinstance(trainer.strategy.precision_plugin, ZenFlowPrecision)
    assert trainer.strategy.precision_plugin.precision == "32-true"
    assert trainer.strategy.zenflow_config.topk_ratio == 0.1
    # Trainer(accelerator, devices) decide the device when the strategy was given none
    assert trainer.strategy.parallel_devices == [torch.device("cpu")]
    assert trainer.strategy.root_device == torch.device("cpu")
    assert trainer.strategy.engine is None  # nothing is started before fit


def test_strategy_by_name_converts_the_precision_flag() -> None:
    trainer = lightning.Trainer(strategy="zenflow", precision="bf16-mixed", accelerator="cpu", devices=1, logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, ZenFlowPrecision)
    assert plugin.precision == "bf16-mixed"
    assert isinstance(plugin._inner, MixedPrecision)
    # Lightning maps 16-mixed to bf16-mixed on the CPU before the strategy sees it
    with pytest.warns(UserWarning, match="bf16-mixed"):
        trainer = lightning.Trainer(strategy="zenflow", precision="16-mixed", accelerator="cpu", logger=False)
    assert trainer.strategy.precision_plugin.precision == "bf16-mixed"


def test_strategy_instance_keeps_its_knobs_and_pickles() -> None:
    strategy = ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.2, update_interval=3, sync_on=["validation"])
    restored = pickle.loads(pickle.dumps(strategy))
    assert restored.zenflow_config == strategy.zenflow_config
    trainer = lightning.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy is strategy
    assert strategy.zenflow_config.topk_ratio == 0.2
    assert strategy.zenflow_config.sync_on == ("validation",)
    assert isinstance(strategy.precision_plugin, ZenFlowPrecision)
    # still picklable once the Trainer has filled in accelerator, precision and devices (ddp_spawn-style pickling)
    restored = pickle.loads(pickle.dumps(strategy))
    assert restored.zenflow_config == strategy.zenflow_config
    assert restored.root_device == torch.device("cpu")


@pytest.mark.parametrize("flag", ["devices", "num_nodes"])
@pytest.mark.parametrize("strategy", ["zenflow", "instance"])
def test_two_devices_or_nodes_make_it_data_parallel(strategy: str, flag: str) -> None:
    from lightning_zenflow import ZenFlowDDPStrategy

    chosen = ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.2) if strategy == "instance" else strategy
    trainer = lightning.Trainer(strategy=chosen, accelerator="cpu", logger=False, **{flag: 2})
    assert isinstance(trainer.strategy, ZenFlowDDPStrategy)
    assert trainer.strategy.world_size == 2
    assert trainer.strategy.zenflow_config.topk_ratio == (0.2 if strategy == "instance" else 0.1)
    assert not multiprocessing.active_children()


@pytest.mark.parametrize(
    ("knobs", "match"),
    [
        ({"topk_ratio": 2}, "topk_ratio=2"),
        ({"update_interval": 0}, "update_interval=0"),
        ({"select_strategy": "step", "select_interval": "auto"}, "integer select_interval"),
        ({"sync_on": ["validaton"]}, "sync_on"),
    ],
)
def test_invalid_knobs_fail_at_construction(knobs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ZenFlowStrategy(**knobs)


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_unsupported_precision_fails_when_the_trainer_is_built(precision: str) -> None:
    with pytest.raises(MisconfigurationException, match=precision) as raised:
        lightning.Trainer(strategy="zenflow", precision=precision, accelerator="cpu", logger=False)
    for supported in ("32-true", "bf16-mixed", "16-mixed", "bf16-true"):
        assert supported in str(raised.value)
    with pytest.raises(MisconfigurationException, match="bf16-true"):
        ZenFlowPrecision(precision)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ errors at fit, before training


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (lambda: TinyModule(optimizer="sgd"), r"returned torch\.optim\.sgd\.SGD\. Return torch\.optim\.AdamW"),
        (lambda: TinyModule(optimizer="two"), r"exactly one optimizer.*single torch\.optim\.AdamW"),
        (lambda: TinyModule(amsgrad=True), r"amsgrad=True.*amsgrad=False"),
    ],
    ids=["sgd", "two-optimizers", "amsgrad"],
)
def test_unsupported_training_setups_fail_before_the_first_step(module, match: str) -> None:  # noqa: ANN001
    model = module()
    trainer = make_trainer(ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.0))
    with pytest.raises(MisconfigurationException, match=match):
        trainer.fit(model)
    assert model.train_losses == []  # no training step ran
    assert trainer.strategy.engine is None
    assert not multiprocessing.active_children()


def test_no_optimizer_is_refused_with_the_fix() -> None:
    class NoOptimizer(TinyModule):
        def configure_optimizers(self):  # noqa: ANN201
            return None

    trainer = make_trainer(ZenFlowStrategy())
    with pytest.raises(MisconfigurationException, match="configure_optimizers returned None.*torch.optim.AdamW"):
        trainer.fit(NoOptimizer())
