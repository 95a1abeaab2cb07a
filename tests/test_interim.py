"""``interim_step``: exact resume with a host step in flight, the degenerate cases, and the refusals.

The update rule itself is checked against ``tests/reference.py`` in ``test_engine_reference.py``
(``test_interim_step_equals_reference``)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn

from lightning_zenflow import UnsupportedSetupError, ZenFlowConfig, ZenFlowEngine

pytestmark = pytest.mark.usefixtures("no_leaked_children")

STEPS = 12
CONFIG = ZenFlowConfig(
    topk_ratio=0.25,
    update_interval=3,
    full_warm_up_rounds=2,
    select_strategy="step",
    select_interval=6,
    interim_step=1.0,
)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 12, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(STEPS)]


BATCHES = _batches()


def _optimizer(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _engine(model: nn.Module, opt: torch.optim.Optimizer, config: ZenFlowConfig = CONFIG) -> ZenFlowEngine:
    return ZenFlowEngine(opt, config, param_names={p: n for n, p in model.named_parameters()})


def _step(engine: ZenFlowEngine, model: nn.Module, opt: torch.optim.Optimizer, t: int) -> None:
    x, y = BATCHES[t - 1]
    nn.functional.mse_loss(model(x), y).backward()
    engine.step()
    opt.zero_grad()


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in model.state_dict().items()}


def test_resume_with_a_step_in_flight_is_bitwise_the_uninterrupted_run() -> None:
    model = _model()
    opt = _optimizer(model)
    history = {}
    with _engine(model, opt) as engine:
        for t in range(1, STEPS + 1):
            _step(engine, model, opt, t)
            history[t] = _weights(model)
            if t == 5:  # a window closed at 5 (W=2, S=3): its host step is in flight
                assert engine.host_in_flight
                snapshot = (copy.deepcopy(engine.state_dict()), copy.deepcopy(model))
        engine.flush()
        final = _weights(model)
    state, saved_model = snapshot
    assert state["progress"]["pending"]["scales"] is not None
    model = saved_model
    opt = _optimizer(model)
    with _engine(model, opt) as engine:
        engine.load_state_dict(copy.deepcopy(state))
        for t in range(6, STEPS + 1):
            _step(engine, model, opt, t)
            for name, value in model.state_dict().items():
                assert torch.equal(value, history[t][name]), f"{name} after step {t}"
        engine.flush()
    for name, value in model.state_dict().items():
        assert torch.equal(value, final[name]), f"{name} after the final flush"


def test_the_moves_change_the_run_and_vanish_at_s1() -> None:
    """The knob matters where S > 1 (a test that it is wired); with S = 1 it is the paper's rule to float rounding."""

    def run(config: ZenFlowConfig) -> dict[str, torch.Tensor]:
        model = _model()
        opt = _optimizer(model)
        with _engine(model, opt, config) as engine:
            for t in range(1, 9):
                _step(engine, model, opt, t)
            engine.flush()
        return _weights(model)

    paper = run(ZenFlowConfig(topk_ratio=0.25, update_interval=3, full_warm_up_rounds=2, interim_step=0))
    moved = run(ZenFlowConfig(topk_ratio=0.25, update_interval=3, full_warm_up_rounds=2, interim_step=1.0))
    assert not torch.equal(paper["0.weight"], moved["0.weight"])
    paper_s1 = run(ZenFlowConfig(topk_ratio=0.25, update_interval=1, full_warm_up_rounds=2, interim_step=0))
    moved_s1 = run(ZenFlowConfig(topk_ratio=0.25, update_interval=1, full_warm_up_rounds=2, interim_step=1.0))
    for name, value in paper_s1.items():
        # the same arithmetic but for where the weight decay is applied: equal to float rounding
        torch.testing.assert_close(moved_s1[name], value, atol=1e-6, rtol=1e-5, msg=name)


def _saved_at_step_5(config: ZenFlowConfig) -> tuple[dict, nn.Module]:
    model = _model()
    opt = _optimizer(model)
    with _engine(model, opt, config) as engine:
        for t in range(1, 6):
            _step(engine, model, opt, t)
        assert engine.host_in_flight
        return copy.deepcopy(engine.state_dict()), copy.deepcopy(model)


def _landed(state: dict, saved_model: nn.Module, config: ZenFlowConfig) -> dict[str, torch.Tensor]:
    """The weights once the saved update in flight has landed, resumed under ``config``."""
    model = copy.deepcopy(saved_model)
    opt = _optimizer(model)
    with _engine(model, opt, config) as engine:
        engine.load_state_dict(copy.deepcopy(state))
        engine.sync()
        if config.topk_ratio == 1.0:
            # every column on the device: the update was taken into the device masters, which the weights show from
            # the next step on
            masters = engine.state_dict(include_moments=False)["params"]
            return {name: masters[name]["master"] for name in _weights(model)}
        return _weights(model)


@pytest.mark.parametrize(
    "knobs", [{"interim_step": 0}, {"topk_ratio": 1.0}, {"topk_ratio": 0.5, "interim_step": 0}], ids=str
)
def test_a_step_in_flight_lands_the_same_under_another_rule(knobs: dict) -> None:
    """Resuming with other knobs: a host step saved under interim moves lands as it would have (the weights, decayed,
    plus the step), whatever the resumed run's rule; and a state saved under the paper's rule resumes under interim."""
    state, saved_model = _saved_at_step_5(CONFIG)
    expected = _landed(state, saved_model, CONFIG)
    other = dataclasses.replace(CONFIG, **knobs)
    got = _landed(state, saved_model, other)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-7, rtol=1e-6, msg=name)
    paper = dataclasses.replace(CONFIG, interim_step=0)
    state, saved_model = _saved_at_step_5(paper)
    expected = _landed(state, saved_model, paper)
    got = _landed(state, saved_model, CONFIG)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=1e-7, rtol=1e-6, msg=name)


def test_fp16_weights_are_refused_at_start() -> None:
    """fp16 weights have no stochastic rounding here (bf16 and fp32 do): refused by name, with the fix."""
    model = _model().to(torch.float16)
    opt = _optimizer(model)
    with pytest.raises(UnsupportedSetupError, match="needs fp32 or bf16 weights.*torch.float16.*interim_step=0"):
        _engine(model, opt).start()


def test_adam_with_l2_weight_decay_is_refused() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, weight_decay=0.1)
    with pytest.raises(UnsupportedSetupError, match="AdamW .decoupled decay. or set interim_step=0"):
        _engine(model, opt).start()


def test_eps_zero_is_refused_at_start_and_at_a_step() -> None:
    """eps=0: a column whose gradients were all 0 has a factored RMS of 0, and its move would be 0 / 0 (a NaN
    weight); refused by group, with the fix, at start and when a group's eps becomes 0 later."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=0.0)
    with pytest.raises(UnsupportedSetupError, match="param group 0 has eps=0.0.*Set eps > 0.*or interim_step=0"):
        _engine(model, opt, ZenFlowConfig(full_warm_up_rounds=0, interim_step=1.5)).start()
    model = _model()
    opt = _optimizer(model)
    with _engine(model, opt, ZenFlowConfig(full_warm_up_rounds=0, interim_step=1.5)) as engine:
        model(torch.randn(4, model[0].in_features)).square().sum().backward()
        engine.step()
        opt.param_groups[0]["eps"] = 0.0
        with pytest.raises(UnsupportedSetupError, match="has eps=0.0"):
            engine.step()


def test_auto_is_on_where_it_applies_and_off_elsewhere() -> None:
    def scale(model: nn.Module, opt: torch.optim.Optimizer, **knobs: object) -> float:
        with _engine(model, opt, ZenFlowConfig(full_warm_up_rounds=0, **knobs)) as engine:
            return engine.interim_scale

    assert scale(_model(), _optimizer(_model())) == 1.5  # docs/update_rule.md, "Defaults, and why"
    model = _model()
    assert scale(model, _optimizer(model), update_interval=1) == 0.0  # nothing to move between updates
    assert scale(model, _optimizer(model), topk_ratio=1.0) == 0.0  # no host columns
    bf16 = _model().to(torch.bfloat16)
    assert scale(bf16, _optimizer(bf16)) == 1.5  # bf16 weights: moves with stochastic rounding
    fp16 = _model().to(torch.float16)
    assert scale(fp16, _optimizer(fp16)) == 0.0  # fp16 weights: the paper's rule
    assert scale(model, torch.optim.Adam(model.parameters(), weight_decay=0.1)) == 0.0  # an L2 term
    assert scale(model, torch.optim.Adam(model.parameters())) == 1.5
    assert scale(model, torch.optim.AdamW(model.parameters(), eps=0.0)) == 0.0  # 0 / 0 where a column never moved


@pytest.mark.parametrize(("interval", "expected"), [(2, 1.5), (4, 1.5), (5, 1.2), (6, 1.0), (8, 0.75), (16, 0.375)])
def test_auto_size_shrinks_beyond_windows_of_four(interval: int, expected: float) -> None:
    """``"auto"``: 1.5 up to S = 4, then 1.5 * 4 / S (docs/update_rule.md, "Defaults, and why"); an explicit size is
    kept at every window."""
    model = _model()
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=interval)
    with _engine(model, _optimizer(model), config) as engine:
        assert engine.interim_scale == pytest.approx(expected)
    model = _model()
    config = ZenFlowConfig(full_warm_up_rounds=0, update_interval=interval, interim_step=1.5)
    with _engine(model, _optimizer(model), config) as engine:
        assert engine.interim_scale == 1.5


@pytest.mark.parametrize("value", [-0.5, 5.0, True, "1", "on"])
def test_bad_values_are_refused(value: object) -> None:
    with pytest.raises((TypeError, ValueError), match="interim_step"):
        ZenFlowConfig(interim_step=value)
