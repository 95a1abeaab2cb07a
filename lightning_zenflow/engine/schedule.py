"""The update rule's schedule: where a run stands in it, with no tensors.

:class:`Schedule` answers, for each optimizer step, *what* happens (warm-up, first selection, a window's first
step, a window end, a refresh) and keeps the bookkeeping of the rule: the step count, the open window and its
accumulator slot, the host update in flight, the last selection. The engine drives it and does the *how*;
``engine/state.py`` serialises it as it is (:meth:`Schedule.state_dict`). See ``docs/update_rule.md``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

AUTO_INITIAL_INTERVAL = 4
"""Window length used by ``update_interval="auto"`` until the first host update has been timed."""
AUTO_MAX_INTERVAL = 64
AUTO_MARGIN = 1.25
"""``"auto"`` sizes the window so that S device steps last this many times one host update."""


@dataclass
class PendingUpdate:
    """A host update that was launched and is not applied to the model yet."""

    slot: int
    """The accumulator slot it consumed (for a model that is not fp32, its staged weights live there)."""
    active: list[list[int]]
    """Per param group, the matrices it updates."""
    computed: bool = False
    """The worker has finished it (the weights wait on the host, or already in the device's upload buffer)."""
    land_at: int | None = None
    """The step at whose end it lands (``land_after``); None: at the next window end."""
    scales: list[list[float]] | None = None
    """``interim_step``: per param group and active matrix, the factor ``1 - lr * weight_decay`` of its window end (1
    where the window kept no gradient); the landing scales the weights by it and adds the step (None: the paper's
    rule, the landing writes the new masters)."""


@dataclass(frozen=True)
class StepPlan:
    """What :meth:`Schedule.begin_step` decided for one step."""

    t: int
    warm_up: bool
    select_first: bool
    """Choose the columns before this step's updates (the first step after warm-up)."""
    first_in_window: bool
    """This step opens a window: its gradient overwrites the accumulator instead of adding to it."""


@dataclass
class Schedule:
    """The position in the rule. Plain integers and lists only: picklable, printable, comparable."""

    warm_up_rounds: int
    interval: int
    interval_decided: bool
    """False while ``update_interval="auto"`` still uses its initial window."""
    window_counts: list[list[int]]
    """Per group, per matrix: how many gradients the open window holds (a matrix without a gradient at a step
    gets none)."""
    refresh_every: int | None = None
    """Steps between selections (None: never refresh)."""
    t: int = 0
    steps_in_window: int = 0
    slot: int = 0
    """The accumulator slot of the open window (the two alternate)."""
    pending: PendingUpdate | None = None
    last_select_t: int | None = None
    selections: int = 0
    window_kept: list[list[int]] | None = None
    """Per group, per matrix: gradients the open window kept (the device counts them, since a 16-mixed overflow
    is known only there); filled from the device when a checkpoint is taken, None otherwise."""
    last_hparams: list[dict] | None = None
    """The hyperparameters (per group, as dicts) of the last step: ``flush()`` closes a partial window with them."""
    _shape: tuple[int, ...] = field(default=(), repr=False)

    @classmethod
    def create(cls, matrices_per_group: Sequence[int], warm_up_rounds: int, update_interval: int | str) -> Schedule:
        auto = update_interval == "auto"
        return cls(
            warm_up_rounds=warm_up_rounds,
            interval=AUTO_INITIAL_INTERVAL if auto else int(update_interval),
            interval_decided=not auto,
            window_counts=[[0] * n for n in matrices_per_group],
            _shape=tuple(matrices_per_group),
        )

    # ------------------------------------------------------------------------------------------- the steps
    def begin_step(self) -> StepPlan:
        self.t += 1
        warm_up = self.t <= self.warm_up_rounds
        return StepPlan(
            t=self.t,
            warm_up=warm_up,
            select_first=not warm_up and self.last_select_t is None,
            first_in_window=self.steps_in_window == 0,
        )

    def add_gradients(self, present: Sequence[Sequence[bool]]) -> None:
        """Count this step's gradients (per group, per matrix) into the open window."""
        for counts, flags in zip(self.window_counts, present):
            for index, has_grad in enumerate(flags):
                counts[index] += int(has_grad)
        self.steps_in_window += 1

    def window_ends(self, plan: StepPlan) -> bool:
        """Whether the open window closes at this step (every warm-up step is a window of one)."""
        return plan.warm_up or self.steps_in_window >= self.interval

    def close_window(self) -> list[list[int]]:
        """End the open window: returns its gradient counts and opens the next one in the other slot."""
        counts = self.window_counts
        self.window_counts = [[0] * len(c) for c in counts]
        self.steps_in_window = 0
        self.slot ^= 1
        return counts

    def refresh_due(self) -> bool:
        return (
            self.refresh_every is not None
            and self.last_select_t is not None
            and self.t - self.last_select_t >= self.refresh_every
        )

    def selected(self) -> None:
        self.last_select_t = self.t
        self.selections += 1

    def decide_interval(self, host_update_s: float, device_step_s: float) -> None:
        """``update_interval="auto"``: fix S once from the first timed host update (see the docs)."""
        self.fix_interval(self.propose_interval(host_update_s, device_step_s))

    @staticmethod
    def propose_interval(host_update_s: float, device_step_s: float) -> int:
        """The S that ``"auto"`` would choose from these timings (data parallel: each rank's proposal, then the
        largest is fixed)."""
        return choose_update_interval(host_update_s, device_step_s)

    def fix_interval(self, interval: int) -> None:
        """``update_interval="auto"``: fix S once (data parallel: the ranks' agreed choice)."""
        if not self.interval_decided:
            self.interval = interval
            self.interval_decided = True

    # ---------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        state = dataclasses.asdict(self)
        state.pop("_shape")
        state.pop("refresh_every")  # comes from the configuration and the data, not from the run
        return state

    def load_state_dict(self, state: Mapping, keep_interval: int | None) -> None:
        """Restore :meth:`state_dict`, after checking it fits this model. ``keep_interval``: the configured
        integer ``update_interval``, which wins over the saved one (the docs say a resumed run takes new knobs)."""
        counts = [list(map(int, c)) for c in state["window_counts"]]
        if tuple(len(c) for c in counts) != tuple(len(c) for c in self.window_counts):
            raise ValueError(
                f"the saved schedule counts matrices per param group {[len(c) for c in counts]}, this model has "
                f"{[len(c) for c in self.window_counts]}; the checkpoint belongs to a different model."
            )
        pending = state["pending"]
        self.t = int(state["t"])
        self.steps_in_window = int(state["steps_in_window"])
        self.slot = int(state["slot"])
        self.window_counts = counts
        self.pending = (
            PendingUpdate(
                slot=int(pending["slot"]),
                active=[list(map(int, a)) for a in pending["active"]],
                computed=bool(pending["computed"]),
                land_at=None if pending.get("land_at") is None else int(pending["land_at"]),
                scales=None if pending.get("scales") is None else [list(map(float, g)) for g in pending["scales"]],
            )
            if pending is not None
            else None
        )
        self.last_select_t = None if state["last_select_t"] is None else int(state["last_select_t"])
        self.selections = int(state["selections"])
        self.last_hparams = state["last_hparams"]
        kept = state.get("window_kept")
        self.window_kept = [list(map(int, k)) for k in kept] if kept is not None else None
        self.interval = int(state["interval"]) if keep_interval is None else keep_interval
        self.interval_decided = bool(state["interval_decided"]) or keep_interval is not None


def choose_update_interval(host_update_s: float, device_step_s: float) -> int:
    """``update_interval="auto"``: the smallest S whose S device steps cover one host update with a margin.

    S = ceil(AUTO_MARGIN * host_update_s / device_step_s), clamped to [1, AUTO_MAX_INTERVAL].
    """
    if device_step_s <= 0:
        return AUTO_MAX_INTERVAL
    return int(min(AUTO_MAX_INTERVAL, max(1, math.ceil(AUTO_MARGIN * host_update_s / device_step_s))))
