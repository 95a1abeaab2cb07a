"""The ZenFlow knobs as one validated dataclass.

This module is the single source of truth for every option: the strategy's signature, the CLI help, the
YAML comments and the knob table of docs/knobs.md are written from the attribute docstrings below. It imports no
Lightning, so the framework-free engine can use it too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Literal

SYNC_BOUNDARIES = ("validation", "epoch_end", "checkpoint")
"""Points at which the strategy can apply all host work in flight (see ``ZenFlowConfig.sync_on``)."""
AUTO_SELECT_STEPS = 64
"""``select_strategy="auto"`` where the epoch's length is unknown (``ZenFlowAdamW`` in a plain loop without
``steps_per_epoch``, a Trainer on an endless data stream): the columns are chosen again every this many optimizer
steps (docs/update_rule.md, "Selection")."""


AUTO_INTERIM_STEP = 1.5
"""``interim_step="auto"``'s size at windows of up to ``AUTO_INTERIM_FULL_UP_TO`` steps: the factored, clipped moves
travel less than AdamW's steps, and with 1.5 every measured fine-tune at S = 4 ended at or below AdamW's held-out loss,
where 1 ended up to 1.2 % above it."""
AUTO_INTERIM_FULL_UP_TO = 4
"""The longest window at which ``"auto"`` takes the whole ``AUTO_INTERIM_STEP``; longer ones take less."""


def auto_interim_step(interval: int) -> float:
    """``interim_step="auto"``'s size at a window of ``interval`` steps (where the moves apply): ``AUTO_INTERIM_STEP``
    up to ``AUTO_INTERIM_FULL_UP_TO`` steps, then ``1.5 * 4 / S`` (1.2 at S 5, 1 at S 6, 0.75 at S 8): with a window
    of 8, each optimizer at its best rate over 450 steps, the moves at 1.5 ended 0.3 % above AdamW, at 1 0.25 % below
    it and at 0.75 0.76 % below (docs/update_rule.md, "Defaults, and why"). 0 at one step (nothing to move)."""
    if interval <= 1:
        return 0.0
    return AUTO_INTERIM_STEP * min(1.0, AUTO_INTERIM_FULL_UP_TO / interval)


@dataclass(frozen=True)
class ZenFlowConfig:
    """Every ZenFlow knob, validated on construction. Names follow DeepSpeed's ``zenflow`` config block."""

    topk_ratio: float = 0.1
    """Fraction of the columns of each weight matrix updated on the device every step (k = ceil(ratio * columns)).
    0 puts every matrix on the host (ZeRO-Offload-like); 1 keeps everything on the device."""

    update_interval: int | Literal["auto"] = 4
    """Steps per host window S: the host accumulates the other columns' gradients for S steps, then runs one
    AdamW step on their mean. ``"auto"`` measures the host update and the device step and picks S so that the
    host update fits inside a window."""

    select_strategy: Literal["auto", "step", "epoch"] = "auto"
    """When the important columns are re-chosen: every ``select_interval`` optimizer steps (``"step"``) or
    epochs (``"epoch"``). ``"auto"``: once per epoch where the epoch's length is known (the Trainer; ``ZenFlowAdamW``
    given ``steps_per_epoch``), else every 64 optimizer steps (a plain loop, an endless data stream). ``"epoch"``
    without a known epoch length selects once and never again."""

    select_interval: int | Literal["auto"] = "auto"
    """Refresh period in the unit of ``select_strategy``; must be ``"auto"`` when the strategy is ``"auto"``.
    Refreshes land on the first window end at or after the period."""

    full_warm_up_rounds: int = 10
    """First optimizer steps run as plain synchronous AdamW over every element (no selection), so that Adam's
    moments are filled before updates arrive late. 0 is the paper's rule (and DeepSpeed's default); 10 removed the
    loss spike that the delayed first host updates cause in a fine-tune (docs/update_rule.md, "Defaults, and why")."""

    overlap_step: bool = True
    """Run the host update asynchronously, overlapped with the next window of device steps (its result lands
    one window later). ``False`` applies it at the window end it was computed for (the device waits)."""

    land_after: int | None = None
    """With ``overlap_step``: the host update lands this many steps after its window closes (1 <= L <=
    ``update_interval``), not at the next window end (``None``, the paper's rule: L = S). A smaller L shortens the
    staleness and costs quality less, but the device waits whenever one host update takes longer than L steps."""

    overlap_after: int = 0
    """With ``overlap_step``: windows that close at an optimizer step <= this land at their own window end (the
    device waits for them, as with ``overlap_step=False``); later ones overlap. A cheaper start than a warm-up: one
    host wait per window instead of one synchronous step per step. 0: every window overlaps (the paper's rule)."""

    interim_step: float | Literal["auto"] = "auto"
    """Moves the host columns between host updates: at every step after warm-up each weight of an unselected column
    moves by ``interim_step * lr * (S - 1) / S`` times its gradient over a factored (per-row x per-column, Adafactor-
    style) estimate of its RMS taken once per window, clipped to [-1, 1], on the device; the host's AdamW step then
    lands on top (added, not overwritten). It closes the gap to AdamW that the window costs (docs/update_rule.md).
    0 is the paper's rule (a host column moves only when its host update lands). A number > 0 needs fp32 or bf16
    weights for the matrices (bf16 ones are written with stochastic rounding), AdamW-style weight decay and eps > 0.
    ``"auto"``: where those hold and S > 1, 1.5 (``AUTO_INTERIM_STEP``) at windows of up to 4 steps and less at longer
    ones (``auto_interim_step``: 0.75 at S 8), else 0; at S 4, 1 moved too little on text the model rarely saw, and at
    S 8, 1.5 moved too far (docs/update_rule.md, "Defaults, and why"). Device cost: one fused pass, about 13 B per
    matrix element a step with fp32 weights, 6.5 B with bf16 (``interim_kernel``); O(rows + columns) fp32 of state."""

    interim_kernel: Literal["auto", "compiled", "eager"] = "auto"
    """How ZenFlow's elementwise kernels run (the interim moves, the landing and the compact state's window sum on the
    device, the AdamW step in the host worker): ``"compiled"`` builds each ahead of its first use, on the training
    thread (and in the worker on a thread of its own), into one fused kernel (``torch.compile``'s ahead-of-time
    build, torch >= 2.9: C++ on a CPU, which needs a C++ compiler; Triton on CUDA); ``"eager"`` runs the same functions
    as several separate passes. On a CPU both give the same bits (the statistics' sums aside: compiled, they add in
    another order), so a call no build accepts runs eagerly without changing a number, and the worker runs its step
    eagerly until its build is ready. ``"auto"``: compiled where a compiler is found and this rank's host-bound matrices
    hold at least 4 M elements (below that the builds cost more than they save), else eager (with a warning when no
    compiler is found); the environment variable ``LIGHTNING_ZENFLOW_KERNELS=eager|compiled`` overrides it. A process
    builds each kernel once (1-3 s each with torch's compile cache warm, 5-20 s with it empty); later fits reuse the
    builds."""

    accumulate_on: Literal["auto", "device", "host"] = "auto"
    """Where the window's unselected gradient columns are summed. ``"device"``: an accumulator on the device (bf16,
    2 B per matrix element, rounded stochastically; fp32 with ``host_state="fp32"``), copied down once per window
    (least link traffic, no model-sized host work per step). ``"host"``: copied down every step and added in fp32 on
    the host (least device memory; 8 B more per parameter on the host). With ``host_state="fp32"`` the two give the
    same numbers. ``"auto"`` picks ``"device"`` when its buffers fit in the device memory free after the first step,
    else ``"host"``."""

    host_state: Literal["fp32", "bf16"] = "bf16"
    """Precision of the optimizer state on the host. ``"bf16"``: the moments and the window's gradient sum in bf16
    (the first moment rounded to nearest, the second and the sum stochastically), the model's weights as the masters
    of the host columns: 6 B per parameter on the host, 2 B for the window's sum on the device. ``"fp32"``: the exact
    state, fp32 moments and sums (and an fp32 master for weights that are not fp32 without interim moves): 12 to 16
    B per parameter on the host, 4 B on the device; with it every degenerate setting equals torch's AdamW to float
    rounding (docs/update_rule.md). Either way Adam's L2 decay (not AdamW's) keeps an fp32 master on the host (4 B
    more)."""

    importance: Literal["l2", "l1"] = "l2"
    """Column score used for selection: squared L2 norm of the column's gradient (the paper) or its L1 sum."""

    expert_layouts: dict[str, Literal["out_in", "in_out"]] | None = None
    """How stacks of expert matrices (3-D parameters, mixture-of-experts layers) are split, where transformers does not
    declare it: a module class name, or a pattern of parameter names, to ``"out_in"`` (``[experts, out, in]``, used
    with ``F.linear``: Qwen3-MoE, Mixtral, ...) or ``"in_out"`` (``[experts, in, out]``, used with ``bmm``: GPT-OSS).
    Such a parameter is split as ``[experts x out, in]`` (``[experts x in, out]``): its columns are the input channels
    the experts share (for ``"in_out"``, the output channels). transformers' own experts modules say their layout
    themselves; a 3-D parameter that is neither named nor declared (nor a convolution's) is split as ``[shape[0],
    the rest]``, said once (docs/llm.md, "Mixture-of-experts models")."""

    sync_on: tuple[str, ...] = ()
    """Opt-in boundaries at which host work in flight is applied early, so the model holds every finished update
    there: any of ``"validation"``, ``"epoch_end"``, ``"checkpoint"``. Each one changes the run's numbers (an update
    lands before its time), so none is on by default: a checkpoint carries the update in flight and resumes
    exactly, validation sees the weights as they stand (host columns up to a window behind, as in training). The
    end of training always closes the open window and applies everything."""

    host_threads: int | None = None
    """Threads of the host worker process. ``None`` gives it the cores that ``pt_reserved_cores_perc`` leaves."""

    pt_reserved_cores_perc: float = 0.5
    """Share of the available cores kept for the training process; the host worker gets the rest (at least
    one). Both sides are pinned to disjoint cores when ``bind_cores`` is on."""

    bind_cores: bool = True
    """Pin the training process and the host worker to disjoint cores and set their thread counts (restored at
    teardown). Off: the worker still uses ``host_threads`` threads but nobody is pinned."""

    worker_timeout_s: float = 10.0
    """A host worker that stops its heartbeat (frozen, stopped) for this long fails the run with a clear error; one
    that dies or raises fails it at once."""

    log_telemetry: bool = True
    """Log ``zenflow/*`` metrics through the Trainer's loggers and show the stall share in the progress bar."""

    checkpoint_format: Literal["full", "sharded"] = "full"
    """``"full"``: one ``.ckpt`` file, the optimizer state consolidated in torch AdamW format (on rank 0 under data
    parallel). ``"sharded"``: a directory where every rank writes its share through torch.distributed.checkpoint,
    for models whose consolidated state does not fit one host; it resumes at any number of ranks, under ZenFlow.
    ``zenflow_fsdp`` defaults to ``"sharded"`` (no rank gathers the model); ``"full"`` there is for small models."""

    def __post_init__(self) -> None:
        # frozen dataclass: normalise through object.__setattr__
        if isinstance(self.sync_on, str):
            object.__setattr__(self, "sync_on", (self.sync_on,))
        object.__setattr__(self, "sync_on", tuple(self.sync_on))
        self._validate()

    def _validate(self) -> None:
        if isinstance(self.topk_ratio, bool) or not isinstance(self.topk_ratio, (int, float)):
            raise TypeError(f"topk_ratio must be a number in [0, 1], got {self.topk_ratio!r}.")
        if not (0.0 <= float(self.topk_ratio) <= 1.0) or math.isnan(self.topk_ratio):
            raise ValueError(
                f"topk_ratio={self.topk_ratio} is outside [0, 1]. Use e.g. topk_ratio=0.1 (10 % of the columns of "
                "each matrix on the device), 0 for everything on the host, 1 for everything on the device."
            )
        _check_int_or_auto("update_interval", self.update_interval, minimum=1)
        if self.select_strategy not in ("auto", "step", "epoch"):
            raise ValueError(
                f"select_strategy={self.select_strategy!r} is not one of 'auto', 'step', 'epoch'. Use 'step' with "
                "select_interval=<steps>, 'epoch' with select_interval=<epochs>, or 'auto' (once per epoch)."
            )
        _check_int_or_auto("select_interval", self.select_interval, minimum=1)
        if self.select_strategy == "auto" and self.select_interval != "auto":
            raise ValueError(
                f"select_strategy='auto' takes select_interval='auto', got select_interval={self.select_interval!r}. "
                f"Set select_strategy='step' (or 'epoch') to use select_interval={self.select_interval!r}."
            )
        if self.select_strategy in ("step", "epoch") and self.select_interval == "auto":
            raise ValueError(
                f"select_strategy={self.select_strategy!r} needs an integer select_interval (how many "
                f"{self.select_strategy}s between refreshes), e.g. select_interval=1."
            )
        if (
            self.select_strategy == "step"
            and isinstance(self.update_interval, int)
            and self.select_interval < self.update_interval
        ):
            raise ValueError(
                f"select_interval={self.select_interval} is shorter than update_interval={self.update_interval}: "
                "refreshes happen at window ends, so set select_interval >= update_interval."
            )
        if isinstance(self.full_warm_up_rounds, bool) or not isinstance(self.full_warm_up_rounds, int):
            raise TypeError(f"full_warm_up_rounds must be an int >= 0, got {self.full_warm_up_rounds!r}.")
        if self.full_warm_up_rounds < 0:
            raise ValueError(f"full_warm_up_rounds={self.full_warm_up_rounds} must be >= 0 (0 turns warm-up off).")
        if not isinstance(self.overlap_step, bool):
            raise TypeError(f"overlap_step must be True or False, got {self.overlap_step!r}.")
        if isinstance(self.overlap_after, bool) or not isinstance(self.overlap_after, int):
            raise TypeError(f"overlap_after must be an int >= 0, got {self.overlap_after!r}.")
        if self.overlap_after < 0:
            raise ValueError(f"overlap_after={self.overlap_after} must be >= 0 (0: every window overlaps).")
        if self.land_after is not None:
            if isinstance(self.land_after, bool) or not isinstance(self.land_after, int) or self.land_after < 1:
                raise ValueError(f"land_after={self.land_after!r} must be None (the next window end) or an int >= 1.")
            if not self.overlap_step:
                raise ValueError(
                    f"land_after={self.land_after} needs overlap_step=True (without overlap the host update lands at "
                    "its own window end); remove land_after or turn overlap on."
                )
            if isinstance(self.update_interval, int) and self.land_after > self.update_interval:
                raise ValueError(
                    f"land_after={self.land_after} is longer than update_interval={self.update_interval}: an update "
                    "lands at the latest at the next window end; use land_after <= update_interval (or None)."
                )
        if self.interim_step == "auto":
            pass
        elif isinstance(self.interim_step, bool) or not isinstance(self.interim_step, (int, float)):
            raise TypeError(f"interim_step must be a number >= 0 or 'auto', got {self.interim_step!r}.")
        elif not (0.0 <= float(self.interim_step) <= 4.0):
            raise ValueError(
                f"interim_step={self.interim_step} is outside [0, 4]: 0 is the paper's rule, 'auto' is "
                f"{AUTO_INTERIM_STEP} at windows of up to {AUTO_INTERIM_FULL_UP_TO} steps (docs/update_rule.md)."
            )
        if self.interim_kernel not in ("auto", "compiled", "eager"):
            raise ValueError(
                f"interim_kernel={self.interim_kernel!r} is not one of 'auto', 'compiled', 'eager'. Use 'auto' "
                "(compiled where a compiler is found), 'compiled' (fail if none is) or 'eager' (never compile)."
            )
        if self.accumulate_on not in ("auto", "device", "host"):
            raise ValueError(
                f"accumulate_on={self.accumulate_on!r} is not one of 'auto', 'device', 'host'. Use 'device' (fastest, "
                "an fp32 accumulator on the device), 'host' (least device memory) or 'auto' (device when it fits)."
            )
        if self.host_state not in ("fp32", "bf16"):
            raise ValueError(
                f"host_state={self.host_state!r} is not one of 'fp32' (the exact state, 12-16 B per parameter on the "
                "host) or 'bf16' (6 B per parameter; the default)."
            )
        if self.importance not in ("l2", "l1"):
            raise ValueError(f"importance={self.importance!r} is not one of 'l2' (squared L2 norm) or 'l1'.")
        if self.expert_layouts is not None:
            from lightning_zenflow.matrices import check_expert_layouts

            object.__setattr__(self, "expert_layouts", check_expert_layouts(self.expert_layouts))
        unknown = [b for b in self.sync_on if b not in SYNC_BOUNDARIES]
        if unknown:
            raise ValueError(f"sync_on has unknown boundaries {unknown}; choose from {list(SYNC_BOUNDARIES)}.")
        if self.host_threads is not None and (
            isinstance(self.host_threads, bool) or not isinstance(self.host_threads, int) or self.host_threads < 1
        ):
            raise ValueError(f"host_threads={self.host_threads!r} must be a positive int or None (automatic).")
        for name in ("pt_reserved_cores_perc", "worker_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}.")
        if not (0.0 <= float(self.pt_reserved_cores_perc) <= 1.0):
            raise ValueError(
                f"pt_reserved_cores_perc={self.pt_reserved_cores_perc} is outside [0, 1]; 0.5 gives the training "
                "process half of the cores and the host worker the other half."
            )
        if not isinstance(self.bind_cores, bool):
            raise TypeError(f"bind_cores must be True or False, got {self.bind_cores!r}.")
        if not isinstance(self.log_telemetry, bool):
            raise TypeError(f"log_telemetry must be True or False, got {self.log_telemetry!r}.")
        if self.checkpoint_format not in ("full", "sharded"):
            raise ValueError(
                f"checkpoint_format={self.checkpoint_format!r} is not one of 'full' (one .ckpt file) or 'sharded' (a "
                "directory written by every rank)."
            )
        if not (float(self.worker_timeout_s) > 0):
            raise ValueError(f"worker_timeout_s={self.worker_timeout_s} must be > 0 seconds.")

    def replace(self, **changes: object) -> ZenFlowConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def core_split(self, available: list[int] | None = None) -> tuple[list[int], list[int]]:
        """Split the available cores into (training process, host worker), disjoint where possible.

        With one core both sides share it. The host worker always gets at least one core.
        """
        cores = sorted(available if available is not None else os.sched_getaffinity(0))
        if len(cores) <= 1:
            return cores, cores
        n_train = int(round(self.pt_reserved_cores_perc * len(cores)))
        n_train = min(max(n_train, 1), len(cores) - 1)
        return cores[:n_train], cores[n_train:]


def _check_int_or_auto(name: str, value: object, minimum: int) -> None:
    if value == "auto":
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum} or 'auto', got {value!r}.")
    if value < minimum:
        raise ValueError(f"{name}={value} must be >= {minimum} (or 'auto').")


def num_selected_columns(columns: int, ratio: float) -> int:
    """k = ceil(ratio * columns), with 0 -> 0 and 1 -> all; float noise below 1e-9 is ignored (0.07*100 -> 7)."""
    if ratio <= 0.0:
        return 0
    if ratio >= 1.0:
        return columns
    return min(columns, max(1, math.ceil(ratio * columns - 1e-9)))


def knob_table() -> str:
    """The knob table of docs/knobs.md, written from this module's attribute docstrings (the single source).

    ``python -m lightning_zenflow.config`` prints it; a test checks docs/knobs.md carries exactly this text.
    """
    import ast
    import inspect

    source = inspect.getsource(ZenFlowConfig)
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    rows = ["| knob | default | what it does |", "|---|---|---|"]
    for node, following in zip(body, body[1:]):
        if not isinstance(node, ast.AnnAssign) or not isinstance(following, ast.Expr):
            continue
        name = node.target.id  # type: ignore[union-attr]
        default = getattr(ZenFlowConfig, name)
        doc = " ".join(str(following.value.value).split()).replace("``", "`")  # type: ignore[union-attr]
        rows.append(f"| `{name}` | `{default!r}` | {doc} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(knob_table())
