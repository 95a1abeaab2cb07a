"""ZenFlow's strategy names in Lightning's registries, without importing Lightning.

``import lightning_zenflow`` has two jobs that pull in opposite directions. In a Lightning program it must make
``Trainer(strategy="zenflow")`` (and ``"zenflow_ddp"``, ``"zenflow_fsdp"``, Fabric's ``"zenflow"``) work: Lightning
has no entry points for strategies, so the names are registered by this import. In a script that only wants the
optimizer (``from lightning_zenflow import ZenFlowAdamW``) it must not import Lightning at all: that costs about 4 s
and 257 modules at every start (jsonargparse included), and the engine never needs it.

So :func:`install` registers the names at once where ``lightning`` is already imported, and otherwise puts a finder
on ``sys.meta_path`` that registers them the moment the ``lightning`` package has finished importing (whatever
imports it: ``import lightning``, ``from lightning.pytorch import Trainer``, a LightningCLI, one of this package's
Lightning modules). The finder answers for those module names only, takes the module spec from the finders after it,
and acts after the module's code has run; every other import passes it by. The hint for your own ``LightningCLI``
(``cli_hint.py``) is installed the same way when ``lightning.pytorch.cli`` is imported. Both happen once.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Sequence
from types import ModuleType


def register_strategies() -> None:
    """Register every ZenFlow strategy name with Lightning's Trainer and Fabric registries (imports Lightning)."""
    from lightning.fabric.strategies import STRATEGY_REGISTRY as FABRIC_STRATEGY_REGISTRY
    from lightning.pytorch.strategies import StrategyRegistry

    from lightning_zenflow.integrations.fabric import ZenFlowFabricStrategy
    from lightning_zenflow.strategies.ddp import ZenFlowDDPStrategy
    from lightning_zenflow.strategies.fsdp import ZenFlowFSDPStrategy
    from lightning_zenflow.strategies.single import ZenFlowStrategy

    ZenFlowStrategy.register_strategies(StrategyRegistry)
    ZenFlowDDPStrategy.register_strategies(StrategyRegistry)
    ZenFlowFSDPStrategy.register_strategies(StrategyRegistry)
    ZenFlowFabricStrategy.register_strategies(FABRIC_STRATEGY_REGISTRY)


def install_cli_hint() -> None:
    from lightning_zenflow.cli_hint import install

    install()  # your own LightningCLI: a hint when a knob is set on the short name


_done = {"strategies": False, "cli_hint": False}


def install() -> None:
    """Register now what can be (Lightning imported already), and watch the imports for the rest (idempotent)."""
    if "lightning" in sys.modules and not _initializing("lightning"):
        _register_if_ready(just_imported=None)
    if "lightning.pytorch.cli" in sys.modules and not _done["cli_hint"]:
        _done["cli_hint"] = True
        install_cli_hint()
    if not all(_done.values()) and not any(isinstance(finder, AfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, AfterImport())


def _initializing(name: str) -> bool:
    """Module ``name`` is being imported (it is in ``sys.modules`` before its code has finished running)."""
    spec = getattr(sys.modules.get(name), "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def _register_if_ready(just_imported: str | None) -> None:
    """Register the names once ``lightning`` is imported and none of this package's modules is half-imported: the
    registration imports the strategy modules, so when the first import of Lightning comes from one of them (``from
    lightning_zenflow import ZenFlowStrategy`` before any ``import lightning``), it waits until that one is done."""
    if _done["strategies"] or "lightning" not in sys.modules:
        return
    if any(
        name.startswith("lightning_zenflow.") and name != just_imported and _initializing(name)
        for name in list(sys.modules)
    ):
        return
    _done["strategies"] = True  # before: the registration's own imports come back here
    try:
        register_strategies()
    except BaseException:
        _done["strategies"] = False
        raise


class AfterImport(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: for ``lightning``, ``lightning.pytorch.cli`` and, until the names are
    registered, this package's modules, it takes the spec from the finders after it and runs the registration (or
    installs the hint) right after the module's code has run. It leaves ``sys.meta_path`` once both are done."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname == "lightning.pytorch.cli" and not _done["cli_hint"]:
            action = self._install_cli_hint
        elif fullname == "lightning" or (fullname.startswith("lightning_zenflow.") and not _done["strategies"]):
            action = _register_if_ready
        else:
            return None
        spec = self._spec_from_the_others(fullname, path, target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def execute_then_act(module: ModuleType) -> None:
            execute(module)
            if module.__name__ != fullname:  # a loader that serves several modules (a zip archive's)
                return
            vars(loader).pop("exec_module", None)  # back to the loader's own method
            action(just_imported=fullname)
            if all(_done.values()) and self in sys.meta_path:
                sys.meta_path.remove(self)

        loader.exec_module = execute_then_act  # type: ignore[method-assign]
        return spec

    @staticmethod
    def _install_cli_hint(just_imported: str | None) -> None:
        if not _done["cli_hint"]:
            _done["cli_hint"] = True
            install_cli_hint()

    def _spec_from_the_others(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None
    ) -> importlib.machinery.ModuleSpec | None:
        for finder in sys.meta_path:
            find_spec = getattr(finder, "find_spec", None)
            if finder is self or find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None
