"""Differential tests: the engine equals ``tests/reference.py`` (the update rule of docs/update_rule.md).

Each case drives one ``ZenFlowEngine`` and one ``ReferenceZenFlow`` with the same random gradient stream
(independent of the weights) and compares, after every step, the weights the model shows; after each
``flush()`` also the fp32 masters, the merged moments of ``torch_state_dict()``, the per-side counts and
the selected columns.

Every case has the same model: three param groups with different lr / betas / eps / weight decay, one of
them Adam (L2 penalty) and two AdamW (decoupled) when the optimizer is ``torch.optim.Adam`` with per-group
``decoupled_weight_decay``, all AdamW when it is ``torch.optim.AdamW``; 0-D, 1-D, 2-D and 4-D parameters; a
frozen parameter; parameters whose gradient is None at some steps (a matrix for a whole window, so its host
update is skipped); a matrix whose gradients are small integers (column scores tie, so tie-breaking
decides the selection); an lr that changes at every step like a scheduler, and betas / eps / weight decay
that change once. The step sequence is 7 steps, ``flush()`` (mid-window for S=3), 7 more, ``sync()`` (a host
update is often in flight then; whether one is in flight is checked against the reference after every step),
2 more, ``flush()``. Column magnitudes are drawn again at every step, so the selection changes at refreshes
and migration moves state both ways (asserted).

The grid. One engine per case costs a host-worker spawn and join (2-4 s on a 2-core machine), so the full
product of all knobs is out of reach. The cases are the full product of the three knobs whose interactions
shape the schedule, rho x S x overlap (4 x 2 x 2 = 16 cases); the four other knobs are assigned over those
16 cases by the formulas in ``_grid()`` so that every value of every knob meets every value of every other
knob at least once (pairwise coverage, checked by ``test_grid_covers_every_pair``):
    W           0 or 2 warm-up steps;
    refresh     "step" with select_interval=S, "step" with select_interval=2S+1, "epoch" (steps_per_epoch=4);
    importance  "l2", "l1";
    optimizer   torch.optim.Adam with per-group Adam/AdamW mixed, torch.optim.AdamW.
(Two of the rho=1 cases have W=0 and need no worker at all.)
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from reference import ReferenceZenFlow, choose_columns, num_columns

from lightning_zenflow.config import AUTO_SELECT_STEPS, ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.export import adamw_state

pytestmark = pytest.mark.usefixtures("no_leaked_children")  # every engine's host worker is joined

ATOL, RTOL = 1e-6, 1e-5

PARAMS = (  # name, shape, group
    ("lin.weight", (6, 10), 0),
    ("lin.bias", (6,), 0),
    ("conv.weight", (4, 3, 2, 2), 0),
    ("wide.weight", (2, 30), 0),  # 0.1 * 30 must give 3 columns, not 4; integer gradients: ties
    ("emb.weight", (5, 8), 1),
    ("norm.weight", (8,), 1),
    ("frozen.weight", (3, 4), 1),
    ("sparse.weight", (4, 7), 2),
    ("scale", (), 2),
)
FROZEN = "frozen.weight"
TIED = "wide.weight"
GROUPS = (
    {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1, "decoupled_weight_decay": True},
    {"lr": 3e-3, "betas": (0.8, 0.99), "eps": 1e-6, "weight_decay": 0.05, "decoupled_weight_decay": False},
    {"lr": 2e-2, "betas": (0.95, 0.9), "eps": 1e-7, "weight_decay": 0.0, "decoupled_weight_decay": True},
)
NO_GRAD_AT = {  # steps at which a parameter's .grad is None
    "sparse.weight": {3, 8, 9, 10},  # 8..10 is a whole S=3 window (windows restart after the flush at 7)
    "lin.bias": {2, 6},
    "emb.weight": {1, 5},  # 1: a matrix without gradient in warm-up (W=2) or at the first selection (W=0)
}
STEPS, FLUSH_AFTER, SYNC_AFTER = 16, 7, 14
STEPS_PER_EPOCH = 4


@dataclass(frozen=True)
class Case:
    ratio: float
    interval: int
    warm_up: int
    overlap: bool
    refresh: str  # "S", "2S+1" or "epoch"
    importance: str
    optimizer: str  # "adam-mixed" or "adamw"
    land_after: int | None = None
    overlap_after: int = 0
    interim: float | str = 0.0
    accumulate_on: str = "auto"
    host_state: str = "fp32"

    @property
    def id(self) -> str:
        return (
            f"rho{self.ratio}-S{self.interval}-W{self.warm_up}-{'overlap' if self.overlap else 'sync'}-"
            f"refresh{self.refresh}-{self.importance}-{self.optimizer}"
            + (f"-L{self.land_after}" if self.land_after is not None else "")
            + (f"-after{self.overlap_after}" if self.overlap_after else "")
            + (f"-interim{self.interim}" if self.interim else "")
            + (f"-acc{self.accumulate_on}" if self.accumulate_on != "auto" else "")
            + f"-{self.host_state}"
        )

    def config(self) -> ZenFlowConfig:
        if self.refresh == "epoch":
            strategy, select_interval = "epoch", 1
        else:
            strategy = "step"
            select_interval = self.interval if self.refresh == "S" else 2 * self.interval + 1
        return ZenFlowConfig(
            topk_ratio=self.ratio,
            update_interval=self.interval,
            select_strategy=strategy,
            select_interval=select_interval,
            full_warm_up_rounds=self.warm_up,
            overlap_step=self.overlap,
            importance=self.importance,
            land_after=self.land_after,
            overlap_after=self.overlap_after,
            interim_step=self.interim,
            accumulate_on=self.accumulate_on,
            host_state=self.host_state,
        )

    @property
    def steps_per_epoch(self) -> int | None:
        return STEPS_PER_EPOCH if self.refresh == "epoch" else None


RATIOS, INTERVALS, WARM_UPS, OVERLAPS = (0.0, 0.1, 0.5, 1.0), (1, 3), (0, 2), (False, True)
REFRESHES, IMPORTANCES, OPTIMIZERS = ("S", "2S+1", "epoch"), ("l2", "l1"), ("adam-mixed", "adamw")
HOST_STATES = ("fp32", "bf16")


def _grid() -> list[Case]:
    cases = []
    for r, s, o in itertools.product(range(4), range(2), range(2)):
        w = (o + r // 2) % 2
        cases.append(
            Case(
                ratio=RATIOS[r],
                interval=INTERVALS[s],
                warm_up=WARM_UPS[w],
                overlap=OVERLAPS[o],
                refresh=REFRESHES[(r + s + w) % 3],
                importance=IMPORTANCES[(s + r // 2) % 2],
                optimizer=OPTIMIZERS[(s + w) % 2],
                host_state=HOST_STATES[(r + o) % 2],
            )
        )
    return cases


GRID = _grid()


def test_grid_covers_every_pair() -> None:
    """Every value of every knob meets every value of every other knob in some case."""
    knobs = {
        "ratio": RATIOS,
        "interval": INTERVALS,
        "warm_up": WARM_UPS,
        "overlap": OVERLAPS,
        "refresh": REFRESHES,
        "importance": IMPORTANCES,
        "optimizer": OPTIMIZERS,
        "host_state": HOST_STATES,
    }
    for (a, values_a), (b, values_b) in itertools.combinations(knobs.items(), 2):
        seen = {(getattr(case, a), getattr(case, b)) for case in GRID}
        assert seen == set(itertools.product(values_a, values_b)), (a, b)
    # and the three schedule knobs form the full product
    assert len({(c.ratio, c.interval, c.overlap) for c in GRID}) == len(GRID) == 16


# ------------------------------------------------------------------------------------------------ harness
def _build(optimizer: str, seed: int, dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape, _ in PARAMS:
        value = torch.randn(shape, generator=generator).to(dtype)
        params[name] = torch.nn.Parameter(value, requires_grad=name != FROZEN)
    groups = []
    for index, hparams in enumerate(GROUPS):
        group = {"params": [params[name] for name, _, g in PARAMS if g == index], **hparams}
        if optimizer == "adamw":
            del group["decoupled_weight_decay"]
        groups.append(group)
    opt = torch.optim.Adam(groups) if optimizer == "adam-mixed" else torch.optim.AdamW(groups)
    return params, opt


def _set_hparams(opt: torch.optim.Optimizer, t: int) -> None:
    """An lr that changes at every step (a scheduler), and betas / eps / weight decay that change once."""
    for index, group in enumerate(opt.param_groups):
        group["lr"] = GROUPS[index]["lr"] * (1.0 + 0.5 * math.sin(t))
    if t == 9:
        opt.param_groups[0]["weight_decay"] = 0.2
        opt.param_groups[1]["betas"] = (0.85, 0.98)
        opt.param_groups[2]["eps"] = 1e-2  # large enough to move updates by ~1 %, far above the tolerance


def _gradients(t: int, generator: torch.Generator, params: dict, dtype: torch.dtype = torch.float32) -> dict:
    """Random gradients, independent of the weights; fresh column magnitudes at every step."""
    grads = {}
    for name, shape, _ in PARAMS:
        if name == FROZEN:
            continue
        if name == TIED:
            sign = torch.randn(shape, generator=generator).sign()
            grad = sign * torch.randint(1, 3, shape, generator=generator).float()
        elif len(shape) >= 2:
            rows, cols = shape[0], math.prod(shape[1:])
            column_scale = torch.exp(1.5 * torch.randn(cols, generator=generator))
            grad = (torch.randn(rows, cols, generator=generator) * column_scale).reshape(shape)
        else:
            grad = torch.randn(shape, generator=generator)
        grads[name] = None if t in NO_GRAD_AT.get(name, ()) else grad.to(dtype)
    return grads


def _assert_weights(params: dict, ref: ReferenceZenFlow, where: str) -> None:
    for name, expected in ref.weights().items():
        # a weight in bf16 is its fp32 master rounded: masters equal to float tolerance may round one ulp apart
        rtol = RTOL if expected.dtype == torch.float32 else 2.0**-7
        torch.testing.assert_close(params[name].detach(), expected, atol=ATOL, rtol=rtol, msg=f"{name} {where}")


def _assert_state(engine: ZenFlowEngine, opt: torch.optim.Optimizer, params: dict, ref: ReferenceZenFlow, where: str):
    saved = engine.state_dict()["params"]
    masters, counts, selected = ref.masters(), ref.counts(), ref.selected_columns()
    for name, expected in masters.items():
        torch.testing.assert_close(saved[name]["master"], expected, atol=ATOL, rtol=RTOL, msg=f"master {name} {where}")
        assert (saved[name]["device_step"], saved[name]["host_step"]) == counts[name], f"counts {name} {where}"
        if name in selected:
            assert torch.equal(saved[name]["selected"], selected[name]), f"selection {name} {where}"
    if ref.interim:  # the moves' statistics, exactly as the reference keeps them
        for matrix in ref.matrices:
            for key, expected in (
                ("interim_row", matrix.interim_row),
                ("interim_col", matrix.interim_col),
                ("interim_decay", matrix.interim_decay),
            ):
                if matrix.interim_decay < 1:
                    got = saved[matrix.name][key]
                    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL, msg=f"{key} {matrix.name} {where}")
    torch_state = engine.torch_state_dict()["state"]
    position_names = {}
    position = 0
    for group in opt.param_groups:
        for param in group["params"]:
            position_names[position] = next(n for n, p in params.items() if p is param)
            position += 1
    moments = ref.moments()
    assert {position_names[p] for p in torch_state} == set(moments)
    betas = {id(param): group["betas"] for group in opt.param_groups for param in group["params"]}
    for position, entry in torch_state.items():
        name = position_names[position]
        exp_avg, exp_avg_sq = moments[name]
        # the engine's moments (each side's, as the rule keeps them) ...
        held = saved[name]
        torch.testing.assert_close(held["exp_avg"], exp_avg, atol=ATOL, rtol=RTOL, msg=f"exp_avg {name} {where}")
        torch.testing.assert_close(
            held["exp_avg_sq"], exp_avg_sq, atol=ATOL, rtol=RTOL, msg=f"exp_avg_sq {name} {where}"
        )
        # ... and the torch format states them at the exported step (engine/export.py)
        exported = adamw_state(held, betas[id(params[name])])
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(entry[key], exported[key]), f"exported {key} {name} {where}"


def _run_against_reference(
    case: Case, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[list, ReferenceZenFlow]:
    params, opt = _build(case.optimizer, seed, dtype)
    names = {param: name for name, param in params.items()}
    frozen_before = params[FROZEN].detach().clone()
    config = case.config()
    ref = ReferenceZenFlow(opt.param_groups, names, config, steps_per_epoch=case.steps_per_epoch)
    generator = torch.Generator().manual_seed(seed + 1)
    history = []
    with ZenFlowEngine(opt, config, param_names=names, steps_per_epoch=case.steps_per_epoch) as engine:
        for t in range(1, STEPS + 1):
            _set_hparams(opt, t)
            grads = _gradients(t, generator, params, dtype)
            for name, grad in grads.items():
                params[name].grad = None if grad is None else grad.clone()
            stats = engine.step()
            info = ref.step(grads)
            history.append((stats, info))
            _assert_weights(params, ref, f"after step {t}")
            assert stats.window_end == info.window_end, f"window end at step {t}"
            assert stats.refreshed == info.selected, f"selection at step {t}"
            assert engine.host_in_flight == bool(ref.pending), f"host update in flight after step {t}"
            if t == FLUSH_AFTER:
                assert case.interval == 1 or ref.steps_in_window > 0, "the flush should close a partial window"
                engine.flush()
                ref.flush()
                _assert_weights(params, ref, f"after the flush at step {t}")
                _assert_state(engine, opt, params, ref, f"after the flush at step {t}")
            if t == SYNC_AFTER:
                engine.sync()
                ref.sync()
                _assert_weights(params, ref, f"after the sync at step {t}")
        engine.flush()
        ref.flush()
        _assert_weights(params, ref, "after the final flush")
        _assert_state(engine, opt, params, ref, "after the final flush")
        assert not engine.host_in_flight
    assert torch.equal(params[FROZEN], frozen_before), "a frozen parameter changed"
    return history, ref


@pytest.mark.parametrize("case", GRID, ids=[case.id for case in GRID])
def test_engine_equals_reference(case: Case) -> None:
    history, ref = _run_against_reference(case)
    selections = [t for t, (stats, _) in enumerate(history, start=1) if stats.refreshed]
    assert selections[0] == case.warm_up + 1
    assert len(selections) >= 2, "the grid must refresh at least once"
    if 0.0 < case.ratio < 1.0:
        # migration really moved columns: the engine saw a new selection, and so did the reference
        overlaps = [stats.selection_overlap for stats, _ in history if stats.selection_overlap is not None]
        assert min(overlaps) < 1.0
        assert ref.selection_changes >= 1


LAND_AFTER_CASES = [
    Case(0.5, 3, 0, True, "S", "l2", "adamw", land_after=1),
    Case(0.1, 3, 2, True, "2S+1", "l1", "adam-mixed", land_after=2),
    Case(0.0, 3, 0, True, "epoch", "l2", "adamw", land_after=1),
    Case(1.0, 3, 0, True, "S", "l2", "adamw", land_after=2),
]


@pytest.mark.parametrize("case", LAND_AFTER_CASES, ids=[case.id for case in LAND_AFTER_CASES])
def test_land_after_equals_reference(case: Case) -> None:
    """``land_after``: the host update lands L steps after its window closes, in the engine as in the reference
    (weights after every step, state after every flush, host work in flight after every step)."""
    history, _ = _run_against_reference(case)
    assert sum(stats.window_end for stats, _ in history) >= 3


OVERLAP_AFTER_CASES = [
    Case(0.5, 3, 0, True, "S", "l2", "adamw", overlap_after=6),  # windows ending at 3 and 6 land at once, then overlap
    Case(0.1, 3, 2, True, "2S+1", "l1", "adam-mixed", overlap_after=7),  # after a warm-up; 7 is not a window end
    Case(0.5, 3, 0, True, "S", "l2", "adamw", land_after=1, overlap_after=4),  # then one step after each window
]


@pytest.mark.parametrize("case", OVERLAP_AFTER_CASES, ids=[case.id for case in OVERLAP_AFTER_CASES])
def test_overlap_after_equals_reference(case: Case) -> None:
    """``overlap_after``: windows that close at steps up to it land at once, later ones overlap (with their lag), in
    the engine as in the reference."""
    history, _ = _run_against_reference(case)
    assert sum(stats.window_end for stats, _ in history) >= 3


INTERIM_CASES = [
    Case(0.5, 3, 0, True, "S", "l2", "adamw", interim=1.0),  # overlap, a refresh at every window end
    Case(0.1, 3, 2, False, "2S+1", "l1", "adamw", interim=1.0, accumulate_on="host"),  # warm-up, no overlap
    Case(0.5, 3, 2, True, "epoch", "l2", "adamw", land_after=1, interim=0.5),
    Case(0.0, 3, 0, True, "S", "l2", "adamw", interim=1.0, accumulate_on="host"),  # every column on the host
    Case(0.1, 1, 0, True, "S", "l2", "adamw", interim=1.0),  # S = 1: no moves, the landing adds the step
    Case(0.5, 5, 0, True, "S", "l2", "adamw", interim="auto"),  # "auto" at a window of 5: 1.5 * 4 / 5
]


@pytest.mark.parametrize("case", INTERIM_CASES, ids=[case.id for case in INTERIM_CASES])
def test_interim_step_equals_reference(case: Case) -> None:
    """``interim_step``: the host columns move at every step on the device and the host step is added when it
    lands, in the engine as in the reference (both accumulation modes, warm-up, refresh and migration, land_after,
    ``"auto"``'s size at a window longer than 4)."""
    history, ref = _run_against_reference(case)
    assert sum(stats.window_end for stats, _ in history) >= (3 if case.interval <= 3 else 2)
    assert all(m.interim_decay < 1 for m in ref.matrices if m.name != "sparse.weight" and not m.selected.all())


def test_land_after_at_the_window_length_is_the_paper_rule() -> None:
    """L = S lands at the next window end: the same numbers as the default."""
    paper = Case(0.5, 3, 0, True, "S", "l2", "adamw")
    same = Case(0.5, 3, 0, True, "S", "l2", "adamw", land_after=3)
    params_a, opt_a = _build("adamw", 0)
    params_b, opt_b = _build("adamw", 0)
    names_a = {param: name for name, param in params_a.items()}
    names_b = {param: name for name, param in params_b.items()}
    gen_a, gen_b = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    with (
        ZenFlowEngine(opt_a, paper.config(), param_names=names_a) as engine_a,
        ZenFlowEngine(opt_b, same.config(), param_names=names_b) as engine_b,
    ):
        for t in range(1, 12):
            for params, opt, gen, engine in ((params_a, opt_a, gen_a, engine_a), (params_b, opt_b, gen_b, engine_b)):
                _set_hparams(opt, t)
                for name, grad in _gradients(t, gen, params).items():
                    params[name].grad = grad
                engine.step()
            for name in params_a:
                assert torch.equal(params_a[name], params_b[name]), (name, t)


@pytest.mark.parametrize("strategy", ["auto", "epoch"])
def test_without_steps_per_epoch_auto_refreshes_on_a_step_cadence_and_epoch_never(strategy: str) -> None:
    """The engine used alone (``ZenFlowAdamW`` in a plain loop) does not know the epoch's length: ``"auto"`` then
    re-selects every ``AUTO_SELECT_STEPS`` steps (at the first window end at or after it), ``"epoch"`` selects once at
    W+1 and never again; the reference follows the same rule, to the bit."""
    params, opt = _build("adamw", seed=5)
    names = {param: name for name, param in params.items()}
    knobs = {"select_strategy": "epoch", "select_interval": 1} if strategy == "epoch" else {}
    config = ZenFlowConfig(topk_ratio=0.5, update_interval=2, full_warm_up_rounds=1, overlap_step=True, **knobs)
    ref = ReferenceZenFlow(opt.param_groups, names, config)
    generator = torch.Generator().manual_seed(6)
    refreshed = []
    steps = 2 * AUTO_SELECT_STEPS + 10
    with ZenFlowEngine(opt, config, param_names=names) as engine:
        assert engine.refresh_every == (AUTO_SELECT_STEPS if strategy == "auto" else None)
        for t in range(1, steps + 1):
            _set_hparams(opt, t)
            grads = _gradients(t, generator, params)
            for name, grad in grads.items():
                params[name].grad = None if grad is None else grad.clone()
            if engine.step().refreshed:
                refreshed.append(t)
            ref.step(grads)
            _assert_weights(params, ref, f"after step {t}")
        engine.flush()
        ref.flush()
        _assert_weights(params, ref, "after the flush")
        _assert_state(engine, opt, params, ref, "after the flush")
    # windows of 2 end at the odd steps: the first at or after 2 + 64 is 67, then 67 + 64 = 131
    expected = [2, 2 + AUTO_SELECT_STEPS + 1, 2 + 2 * AUTO_SELECT_STEPS + 1] if strategy == "auto" else [2]
    assert refreshed == expected


# ------------------------------------------------------------------- the reference itself, without the engine
def test_reference_column_choice() -> None:
    assert num_columns(30, 0.1) == 3
    assert [num_columns(7, r) for r in (0.0, 0.01, 0.5, 1.0)] == [0, 1, 4, 7]
    # ties go to the lower index
    mask = choose_columns([1.0, 3.0, 1.0, 3.0, 2.0], 3)
    assert mask.nonzero().flatten().tolist() == [1, 3, 4]
    assert choose_columns([0.0] * 5, 2).nonzero().flatten().tolist() == [0, 1]


@pytest.mark.parametrize(
    ("ratio", "overlap", "optimizer"), [(1.0, True, "adamw"), (0.0, False, "adam-mixed"), (1.0, False, "adam-mixed")]
)
def test_reference_degenerate_cases_equal_torch(ratio: float, overlap: bool, optimizer: str) -> None:
    """The reference is right where torch can tell: rho=1 (any S) and rho=0, S=1, no overlap are torch Adam/AdamW."""
    params, opt = _build(optimizer, seed=3)
    names = {param: name for name, param in params.items()}
    interval = 3 if ratio == 1.0 else 1
    config = ZenFlowConfig(
        full_warm_up_rounds=0,
        topk_ratio=ratio,
        update_interval=interval,
        overlap_step=overlap,
        select_strategy="step",
        select_interval=3,
        host_state="fp32",
    )
    ref = ReferenceZenFlow(opt.param_groups, names, config)
    generator = torch.Generator().manual_seed(4)
    for t in range(1, 9):
        _set_hparams(opt, t)
        grads = _gradients(t, generator, params)
        for name, grad in grads.items():
            params[name].grad = grad
        opt.step()
        ref.step(grads)
        _assert_weights(params, ref, f"after step {t}")
    moments = ref.moments()
    for name, param in params.items():
        if name != FROZEN:
            torch.testing.assert_close(opt.state[param]["exp_avg"], moments[name][0], atol=ATOL, rtol=RTOL)
            torch.testing.assert_close(opt.state[param]["exp_avg_sq"], moments[name][1], atol=ATOL, rtol=RTOL)


COMPACT_DEGENERATE_CASES = [
    Case(
        0.0, 1, 0, False, "S", "l2", "adamw", host_state="bf16"
    ),  # ZeRO-Offload: every column on the host, synchronous
    Case(0.0, 1, 2, True, "S", "l1", "adam-mixed", host_state="bf16"),  # the same one step late, after a warm-up
    Case(0.0, 1, 0, False, "S", "l2", "adam-mixed", host_state="bf16", accumulate_on="host"),
]


@pytest.mark.parametrize("case", COMPACT_DEGENERATE_CASES, ids=[case.id for case in COMPACT_DEGENERATE_CASES])
def test_the_compact_state_equals_the_reference_bit_for_bit_where_every_column_is_on_the_host(case: Case) -> None:
    """rho = 0 and S = 1 in the compact state: the engine (the window's sum rounded stochastically on the device, the
    worker's step with bf16 moments, the step rounded into the bf16 window row, the landing) gives the reference's
    bits, not only its numbers to a tolerance, for every matrix after every step."""
    params, opt = _build(case.optimizer, seed=5)
    names = {param: name for name, param in params.items()}
    config = case.config()
    ref = ReferenceZenFlow(opt.param_groups, names, config)
    generator = torch.Generator().manual_seed(6)
    matrices = [name for name, shape, _ in PARAMS if len(shape) >= 2 and name != FROZEN]
    with ZenFlowEngine(opt, config, param_names=names) as engine:
        for t in range(1, 10):
            _set_hparams(opt, t)
            grads = _gradients(t, generator, params)
            for name, grad in grads.items():
                params[name].grad = None if grad is None else grad.clone()
            engine.step()
            ref.step(grads)
            if case.overlap:
                engine.sync()
                ref.sync()
            shown = ref.weights()
            for name in matrices:
                assert torch.equal(params[name].detach(), shown[name]), f"{name} after step {t}"
        engine.flush()
        ref.flush()
        saved, moments = engine.state_dict()["params"], ref.moments()
        for name in matrices:
            assert torch.equal(params[name].detach(), ref.weights()[name]), f"{name} after the flush"
            exp_avg, exp_avg_sq = moments[name]
            assert torch.equal(saved[name]["exp_avg"].float(), exp_avg), name
            assert torch.equal(saved[name]["exp_avg_sq"].float(), exp_avg_sq), name


BF16_MODEL_CASES = [dataclasses.replace(GRID[index], host_state="fp32") for index in (7, 11)]


@pytest.mark.parametrize("case", BF16_MODEL_CASES, ids=[case.id for case in BF16_MODEL_CASES])
def test_bf16_model_equals_reference(case: Case) -> None:
    """A bf16 model in the exact state: fp32 masters and moments equal the reference's to float tolerance at every
    flush, and the bf16 weights are those masters rounded (to one ulp). (In the compact state the bf16 weights are
    the masters of host columns, rounded stochastically where a step lands: ``tests/test_host_state.py``.)"""
    history, ref = _run_against_reference(case, seed=7, dtype=torch.bfloat16)
    assert any(stats.window_end for stats, _ in history)
    assert all(w.dtype == torch.bfloat16 for name, w in ref.weights().items() if name != FROZEN)
