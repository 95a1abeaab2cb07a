"""ZenFlowPrecision: the precision plugin that owns the optimizer step.

``optimizer_step`` runs the closure (forward + backward), unscales (16-mixed), fires Lightning's hooks and
gradient clipping, hands the gradients to the engine and returns without waiting for host work. Everything
else (autocast, dtype conversion, loss scaling) is delegated to the Lightning precision plugin it wraps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any, Literal

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_debug
from typing_extensions import override

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from lightning_zenflow.engine import ZenFlowEngine
    from lightning_zenflow.strategies.manual import ManualOptimizers

SUPPORTED_PRECISION = ("32-true", "32", "bf16-mixed", "16-mixed", "bf16-true")
_PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true"]


def _unsupported_precision(name: str) -> MisconfigurationException:
    return MisconfigurationException(
        f"ZenFlow does not support precision={name!r}. Set Trainer(precision=...) to one of '32-true', "
        "'bf16-mixed', '16-mixed' (fp16 autocast with loss scaling; Lightning turns it into 'bf16-mixed' on the "
        "CPU) or 'bf16-true' (bf16 weights on the device, fp32 master weights and moments in the engine)."
    )


class ZenFlowPrecision(Precision):
    """Precision plugin for ZenFlow. Built automatically when ``Trainer(strategy="zenflow", precision=...)``.

    Args:
        precision: ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"`` or ``"bf16-true"``.
        device: ``"cuda"`` or ``"cpu"``, for autocast and the loss scaler of the mixed modes; default ``"cuda"``
            when CUDA is available, else ``"cpu"`` (autocast for a device that is not there would silently do
            nothing).
    """

    def __init__(self, precision: _PrecisionName = "32-true", device: str | None = None) -> None:
        super().__init__()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        name = str(precision)
        if name == "32":
            name = "32-true"
        if name not in SUPPORTED_PRECISION:
            raise _unsupported_precision(name)
        self.precision = name  # type: ignore[assignment]
        if name in ("bf16-mixed", "16-mixed"):
            self._inner: Precision = MixedPrecision(name, device=device)  # type: ignore[arg-type]
        elif name == "bf16-true":
            self._inner = HalfPrecision("bf16-true")
        else:
            self._inner = Precision()
        self.engine: ZenFlowEngine | None = None
        self.before_engine_step: Callable[[], None] | None = None
        """Set by the strategy while fitting."""
        self.manual: ManualOptimizers | None = None
        """Manual optimization: the optimizers' engines (``strategies/manual.py``), set by the strategy."""

    @classmethod
    def from_plugin(cls, plugin: Precision) -> ZenFlowPrecision:
        """Wrap the plugin the accelerator connector built from ``Trainer(precision=...)``."""
        if isinstance(plugin, ZenFlowPrecision):
            return plugin
        name = str(getattr(plugin, "precision", "32-true"))
        if type(plugin) not in (Precision, MixedPrecision, HalfPrecision) or name not in SUPPORTED_PRECISION:
            raise _unsupported_precision(f"{name} ({type(plugin).__name__})")
        wrapped = cls.__new__(cls)
        Precision.__init__(wrapped)
        wrapped.precision = "32-true" if name == "32" else name  # type: ignore[assignment]
        wrapped._inner = plugin
        wrapped.engine = None
        wrapped.before_engine_step = None
        wrapped.manual = None
        return wrapped

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return getattr(self._inner, "scaler", None)

    # -------------------------------------------------------------------------------- the optimizer step
    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.engine is None:
            if self.manual is not None:
                # manual optimization: the optimizer is a ZenFlowAdamW with its own engine; Lightning's plugin steps
                # it as it steps any optimizer (GradScaler.step hands it the overflow flag on the device)
                return self._inner.optimizer_step(optimizer, model=model, closure=closure, **kwargs)
            raise RuntimeError("ZenFlowPrecision.optimizer_step was called without a running ZenFlow engine.")
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # Lightning's way to skip a batch: training_step returned None, no backward ran. As under Lightning's own
            # plugins the step's hooks run and the optimizer changes nothing; here the engine takes no step at all
            # (its rule counts the steps it is given: windows and refreshes count the batches that trained).
            self._after_closure(model, optimizer)
            return closure_result
        scaler = self.scaler
        if scaler is not None:
            # unscale before the hooks and clipping see the gradients, as Lightning's AMP plugin does
            scaler.unscale_(optimizer)
        self._after_closure(model, optimizer)
        found_inf = None
        if scaler is not None:
            # the overflow flag stays on the device: the engine skips an overflowed step there (no host read)
            found_inf = _found_inf(scaler, optimizer)
            scaler.update()
        announce = self.engine.accumulate_on is None
        if self.before_engine_step is not None:
            self.before_engine_step()  # FSDP2: the local shards' gradients handed to the engine's parameters
        self.engine.step(found_inf)
        if announce:
            # the first step decides where gradients accumulate ("auto" measures the free device memory then); a
            # debug line (logging "lightning.pytorch" at DEBUG shows it), also in the telemetry's accumulate_on
            rank_zero_debug(f"ZenFlow: {self.engine.accumulate_on_reason}.")
        return closure_result

    @override
    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        if self.engine is not None:
            # backward writes the gradients (accumulating micro-batches, DDP's bucket views): GPU-side, after the
            # engine's device work of the last step has read them
            self.engine.wait_for_gradients()
        if self.manual is not None:
            self.manual.wait_for_gradients()  # the same for every optimizer's engine
        return self._inner.pre_backward(tensor, module)

    # ----------------------------------------------------------------------------------- delegation
    @override
    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return self._inner.convert_module(module)

    @override
    def convert_input(self, data: Any) -> Any:
        return self._inner.convert_input(data)

    @override
    def convert_output(self, data: Any) -> Any:
        return self._inner.convert_output(data)

    @override
    def tensor_init_context(self) -> contextlib.AbstractContextManager:
        return self._inner.tensor_init_context()

    @override
    def module_init_context(self) -> contextlib.AbstractContextManager:
        return self._inner.module_init_context()

    @override
    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        with self._inner.forward_context():
            yield

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._inner.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._inner.load_state_dict(state_dict)

    @override
    def teardown(self) -> None:
        self.engine = None
        self.before_engine_step = None
        self.manual = None
        self._inner.teardown()


def _found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The overflow flag ``scaler.unscale_(optimizer)`` left (a device scalar, 1.0 when a gradient is inf/NaN);
    read on the device by the engine, never on the host."""
    per_device = list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
    flag = per_device[0]
    for other in per_device[1:]:
        flag = flag + other.to(flag.device)
    return flag.clamp(max=1.0)
