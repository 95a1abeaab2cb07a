"""``ZenFlowAdamW`` keeps ``torch.optim.AdamW``'s contract where PyTorch's own ``test/test_optim.py`` found it broken: a
step without gradients is a no-op that runs the step hooks, states load between optimizers built with and without
parameter names, ``copy.deepcopy`` gives a working optimizer, AdamW's keywords (``maximize`` included), and subclasses
that only preset knobs (CPU)."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import spawned_children
from lightning_helpers import assert_weights_close, assert_weights_equal, weights
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from lightning_zenflow import ZenFlowAdamW
from lightning_zenflow.engine.errors import UnsupportedSetupError
from lightning_zenflow.optim import TORCH_OPTIONS

pytestmark = pytest.mark.usefixtures("no_leaked_children")

DEVICE_ONLY = {"full_warm_up_rounds": 0, "topk_ratio": 1.0}
HOST_SYNC = {
    "full_warm_up_rounds": 0,
    "topk_ratio": 0.0,
    "update_interval": 1,
    "overlap_step": False,
    "host_state": "fp32",
}
EXACT = pytest.mark.parametrize("knobs", [DEVICE_ONLY, HOST_SYNC], ids=["device_only", "host_sync"])
SHORT = {"full_warm_up_rounds": 2, "update_interval": 3}
"""The rule with every part in play within a few steps: a warm-up, windows, a host update in flight (overlapped)."""


def _batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)) for _ in range(steps)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches, sign: float = 1.0) -> None:
    for inputs, targets in batches:
        (sign * nn.functional.mse_loss(model(inputs), targets)).backward()
        optimizer.step()
        optimizer.zero_grad()


def _public(optimizer: torch.optim.Optimizer) -> set[str]:
    """The public attributes of an instance, as torch's ``test_deepcopy_copies_all_public_attrs`` reads them."""
    return {name for name in vars(optimizer) if not name.startswith("_")}


# ----------------------------------------------------------------------------- 1. a step without gradients
@pytest.mark.parametrize("case", ["frozen", "no_grad_yet"])
def test_a_step_without_gradients_is_a_no_op_that_runs_the_hooks(case: str) -> None:
    """As AdamW: nothing changes, the closure's loss comes back, and the instance and global step hooks run around
    every step. No engine and no host worker are started for it."""

    def run(make):
        params = [torch.randn(4, 3, requires_grad=case == "no_grad_yet"), torch.randn(3, requires_grad=False)]
        before = [p.detach().clone() for p in params]
        optimizer = make(params)
        calls = []
        handles = [
            optimizer.register_step_pre_hook(lambda *_: calls.append("pre")),
            optimizer.register_step_post_hook(lambda *_: calls.append("post")),
            register_optimizer_step_pre_hook(lambda *_: calls.append("global pre")),
            register_optimizer_step_post_hook(lambda *_: calls.append("global post")),
        ]
        try:
            losses = [optimizer.step(lambda: torch.tensor(3.0)), optimizer.step()]
        finally:
            for handle in handles:
                handle.remove()
        assert all(torch.equal(p, b) for p, b in zip(params, before))
        return optimizer, calls, losses

    started = spawned_children()
    _, control_calls, control_losses = run(lambda p: torch.optim.AdamW(p, lr=1e-2))
    optimizer, calls, losses = run(lambda p: ZenFlowAdamW(p, lr=1e-2, full_warm_up_rounds=1))
    assert calls == control_calls == ["global pre", "pre", "post", "global post"] * 2
    assert losses == control_losses == [torch.tensor(3.0), None]
    assert optimizer.engine is None, "no engine for a step that applies nothing"
    assert not spawned_children() - started, "no host worker started"
    assert optimizer.state_dict()["state"] == {}
    optimizer.close()


@EXACT
def test_steps_without_gradients_between_real_ones_change_nothing(knobs: dict) -> None:
    """A running engine does not count them either: the run equals AdamW's, and the engine counts the real steps."""
    batches = _batches(6)

    def run(make):
        model = _model()
        optimizer = make(model.parameters())
        for step, (inputs, targets) in enumerate(batches):
            nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad()
            optimizer.step()  # no gradient left: a no-op
            if step == 2:  # everything frozen for one step
                model.requires_grad_(False)
                optimizer.step()
                model.requires_grad_(True)
        return model, optimizer

    control, _ = run(lambda p: torch.optim.AdamW(p, lr=1e-2))
    model, optimizer = run(lambda p: ZenFlowAdamW(p, lr=1e-2, **knobs))
    assert optimizer.engine.t == len(batches)
    optimizer.close()
    assert_weights_close(weights(model), weights(control))


# ----------------------------------------------------------------------------- 2. named and positional states
def _params(model: nn.Module, named: bool):
    return model.named_parameters() if named else model.parameters()


@pytest.mark.parametrize("saved_named", [True, False], ids=["saved_named", "saved_positional"])
@pytest.mark.parametrize("loaded_named", [True, False], ids=["loaded_named", "loaded_positional"])
def test_a_state_loads_between_named_and_positional_optimizers(saved_named: bool, loaded_named: bool) -> None:
    """Saved mid-window with a host update in flight, loaded into an optimizer built the other way (after it has
    stepped, so its engine runs with its own names): it continues bitwise as the uninterrupted run."""
    batches = _batches(14)
    reference = _model()
    with ZenFlowAdamW(reference.parameters(), lr=1e-2, **SHORT) as optimizer:
        _train(reference, optimizer, batches)
    model = _model()
    first = ZenFlowAdamW(_params(model, saved_named), lr=1e-2, **SHORT)
    _train(model, first, batches[:7])
    saved = copy.deepcopy(first.state_dict())
    first.close()
    assert saved["zenflow"]["progress"]["pending"] is not None, "a host update in flight"
    assert sorted(saved["zenflow"]["params"]) == [f"group0.param{i}" for i in range(4)], "keyed by position"
    resumed = copy.deepcopy(model)
    at_save = copy.deepcopy(resumed.state_dict())
    with ZenFlowAdamW(_params(resumed, loaded_named), lr=1e-2, **SHORT) as second:
        _train(resumed, second, batches[:1])  # its engine starts, with its own names
        resumed.load_state_dict(at_save)
        second.load_state_dict(saved)
        _train(resumed, second, batches[7:])
    assert_weights_equal(weights(resumed), weights(reference))


def test_a_state_of_other_parameters_is_refused_before_anything_is_loaded() -> None:
    model = _model()
    with ZenFlowAdamW(model.named_parameters(), lr=1e-2, **DEVICE_ONLY) as optimizer:
        _train(model, optimizer, _batches(2))
        saved = copy.deepcopy(optimizer.state_dict())
    wrapped = nn.Sequential(_model())  # the same layers, named "0.0.weight", ...
    other = nn.Sequential(nn.Linear(8, 12), nn.Tanh(), nn.Linear(12, 4))
    cases = [
        (wrapped.named_parameters(), r"'0\.weight' \(saved\) is '0\.0\.weight' here.*model\.parameters\(\)"),
        (other.parameters(), r"other shapes: param group 0 index 0: saved \(16, 8\), here \(12, 8\)"),
        (list(model.parameters())[:2], r"1 param group\(s\) of \[4\] parameters, this optimizer 1 of \[2\]"),
    ]
    for params, message in cases:
        with ZenFlowAdamW(params, lr=5e-3, **DEVICE_ONLY) as loader:
            with pytest.raises(ValueError, match=message):
                loader.load_state_dict(saved)
            assert loader.param_groups[0]["lr"] == 5e-3, "nothing loaded"
            assert loader.engine is None
    # a model renamed as a whole loads by position when the optimizer is built without names
    with ZenFlowAdamW(wrapped.parameters(), lr=5e-3, **DEVICE_ONLY) as loader:
        loader.load_state_dict(saved)
        assert loader.param_groups[0]["lr"] == 1e-2


def _without_names(state_dict: dict) -> dict:
    """The state without ``param_names``: what torch's ``test_state_dict_deterministic`` lets differ between an
    optimizer built with names and one built without."""
    state_dict = copy.deepcopy(state_dict)
    for group in state_dict["param_groups"]:
        group.pop("param_names", None)
    return state_dict


def _assert_states_equal(actual: object, expected: object) -> None:
    if isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert actual.keys() == expected.keys()
        for key in expected:
            _assert_states_equal(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            _assert_states_equal(a, e)
    else:
        assert actual == expected


@pytest.mark.parametrize("named", [(False, False), (True, True), (True, False), (False, True)], ids=str)
def test_state_dict_is_deterministic(named: tuple[bool, bool]) -> None:
    """torch's ``test_state_dict_deterministic``: two calls give equal states; a state loaded into an optimizer over
    cloned parameters (built with or without names) runs in step with the original and gives an equal state, apart
    from torch's own ``param_names`` (the engine's extras are keyed by position either way)."""
    weight = nn.Parameter(torch.randn(2, 3, generator=torch.Generator().manual_seed(1)))
    bias = nn.Parameter(torch.randn(2, generator=torch.Generator().manual_seed(2)))
    inputs = torch.randn(3, generator=torch.Generator().manual_seed(3))

    def make(params, is_named):
        return ZenFlowAdamW([(f"name{i}", p) for i, p in enumerate(params)] if is_named else params, **SHORT)

    def closure(optimizer, w, b):
        optimizer.zero_grad()
        (w.mv(inputs) + b).pow(2).sum().backward()

    optimizer = make([weight, bias], named[0])
    for _ in range(10):
        closure(optimizer, weight, bias)
        optimizer.step()
    _assert_states_equal(optimizer.state_dict(), optimizer.state_dict())
    with torch.no_grad():
        weight_c, bias_c = nn.Parameter(weight.clone()), nn.Parameter(bias.clone())
    optimizer_c = make([weight_c, bias_c], named[1])
    optimizer_c.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    for _ in range(10):
        closure(optimizer, weight, bias)
        closure(optimizer_c, weight_c, bias_c)
        optimizer.step()
        optimizer_c.step()
        assert torch.equal(weight, weight_c)
        assert torch.equal(bias, bias_c)
    _assert_states_equal(_without_names(optimizer_c.state_dict()), _without_names(optimizer.state_dict()))
    optimizer.close()
    optimizer_c.close()


# ----------------------------------------------------------------------------- 3. deepcopy
@pytest.mark.parametrize("copied_at", [0, 6], ids=["before_steps", "update_in_flight"])
def test_a_deepcopy_has_the_same_attributes_and_continues_on_its_own_worker(copied_at: int) -> None:
    """The copy has AdamW's public attributes (no instance ``zero_grad`` left by the engine), starts its own engine and
    worker at its first step, and continues from the original's state; the original trains on as if never copied."""
    batches = _batches(10)
    reference = _model()
    with ZenFlowAdamW(reference.parameters(), lr=1e-2, **SHORT) as optimizer:
        _train(reference, optimizer, batches)
    model = _model()
    optimizer = ZenFlowAdamW(model.parameters(), lr=1e-2, **SHORT)
    _train(model, optimizer, batches[:copied_at])
    assert copied_at == 0 or optimizer.engine.host_in_flight
    model_copy, optimizer_copy = copy.deepcopy((model, optimizer))  # the copy's parameters are the copied model's
    plain_model = _model()
    plain = torch.optim.AdamW(plain_model.parameters())
    _train(plain_model, plain, batches[:1])
    assert _public(optimizer) == _public(optimizer_copy) == _public(plain)
    assert optimizer_copy.engine is None
    assert optimizer_copy.param_groups[0]["params"][0] is model_copy[0].weight
    _train(model_copy, optimizer_copy, batches[copied_at : copied_at + 1])
    _train(model, optimizer, batches[copied_at : copied_at + 1])
    assert None not in (optimizer.engine.worker_pid, optimizer_copy.engine.worker_pid)
    assert optimizer.engine.worker_pid != optimizer_copy.engine.worker_pid, "each engine has its own worker"
    _train(model, optimizer, batches[copied_at + 1 :])
    _train(model_copy, optimizer_copy, batches[copied_at + 1 :])
    for each in (optimizer, optimizer_copy):
        each.flush()
        each.close()
    assert_weights_equal(weights(model), weights(reference))
    assert_weights_equal(weights(model_copy), weights(reference))


# ----------------------------------------------------------------------------- 4. AdamW's keywords
def test_adamws_keywords_at_the_values_zenflow_runs_are_accepted() -> None:
    accepted = {"maximize": False, "foreach": False, "capturable": False, "differentiable": False, "fused": False}
    for kwargs in ({}, accepted, {**accepted, "foreach": None, "fused": None}):
        optimizer = ZenFlowAdamW(_model().parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.1, False, **kwargs)
        control = torch.optim.AdamW(_model().parameters(), 1e-2, (0.9, 0.99), 1e-8, 0.1, False, **kwargs)
        assert optimizer.state_dict()["param_groups"] == control.state_dict()["param_groups"]
        optimizer.close()


@pytest.mark.parametrize("flags", [{"fused": True}, {"foreach": True}, {"fused": False, "foreach": False}], ids=str)
def test_fused_and_foreach_are_accepted_with_any_value_and_change_no_number(flags: dict) -> None:
    """As public training scripts build AdamW on CUDA (``AdamW(groups, lr=..., betas=..., fused=True)``): accepted, kept
    in the param groups as AdamW keeps them, and the run is bitwise the run without the flag (the constructor's
    arguments are all the flag reaches: no CUDA needed)."""
    batches = _batches(12)

    def run(**options):
        model = _model()
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters(), "weight_decay": 0.0}]
        with ZenFlowAdamW(groups, lr=1e-2, betas=(0.9, 0.95), **options, **SHORT) as optimizer:
            assert all(group.get(name) == value for group in optimizer.param_groups for name, value in options.items())
            _train(model, optimizer, batches)
        return weights(model)

    assert_weights_equal(run(**flags), run())
    model = _model()
    control = torch.optim.AdamW(model[0].parameters(), lr=1e-2, **flags)
    with ZenFlowAdamW(model[0].parameters(), lr=1e-2, **flags) as optimizer:
        assert optimizer.state_dict()["param_groups"] == control.state_dict()["param_groups"]
        optimizer.add_param_group({"params": model[2].parameters(), **flags})  # a group may set them too


@pytest.mark.parametrize(("name", "value"), [(name, True) for name in TORCH_OPTIONS])
def test_other_values_of_adamws_keywords_are_refused_by_name(name: str, value: object) -> None:
    fix = rf"{name}={value} is not supported: .*leave {name} unset"
    with pytest.raises(ValueError, match=fix):
        ZenFlowAdamW(_model().parameters(), **{name: value})
    model = _model()
    with pytest.raises(ValueError, match=f"param group 0: {fix}"):
        ZenFlowAdamW([{"params": model[0].parameters(), name: value}])
    with ZenFlowAdamW(model[0].parameters()) as optimizer:
        with pytest.raises(ValueError, match=f"param group 1: {fix}"):
            optimizer.add_param_group({"params": model[2].parameters(), name: value})
        assert len(optimizer.param_groups) == 1


@EXACT
def test_maximize_equals_torch_adamw(knobs: dict) -> None:
    """``maximize=True`` on one param group: AdamW's numbers; every gradient left as backward made it, unwritten."""
    batches = _batches(8)

    def run(make):
        model = _model()
        optimizer = make([{"params": model[0].parameters(), "maximize": True}, {"params": model[2].parameters()}])
        for inputs, targets in batches:
            nn.functional.mse_loss(model(inputs), targets).backward()
            grads = [p.grad.clone() for p in model.parameters()]
            versions = [p.grad._version for p in model.parameters()]
            optimizer.step()
            assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
            # never written, not even negated and back (torch's test_grads_are_never_inplaced_into)
            assert [p.grad._version for p in model.parameters()] == versions
            optimizer.zero_grad()
        if isinstance(optimizer, ZenFlowAdamW):
            optimizer.close()
        return model

    control = run(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    model = run(lambda groups: ZenFlowAdamW(groups, lr=1e-2, **knobs))
    assert_weights_close(weights(model), weights(control))
    minimized = run(lambda groups: torch.optim.AdamW([{**g, "maximize": False} for g in groups], lr=1e-2))
    assert not torch.allclose(weights(model)["0.weight"], weights(minimized)["0.weight"])


def test_maximize_is_minimizing_the_negated_loss_under_the_whole_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows, host updates in flight, selections: ``maximize=True`` on a loss is, bitwise, the run on its negation.
    The CPU lanes delay their work at random: the negated copies are kept until the engine has read them."""
    monkeypatch.setenv("LIGHTNING_ZENFLOW_LANES", "adversarial")
    batches = _batches(12)
    model = _model()
    with ZenFlowAdamW(model.parameters(), lr=1e-2, maximize=True, **SHORT) as optimizer:
        _train(model, optimizer, batches)
    negated = _model()
    with ZenFlowAdamW(negated.parameters(), lr=1e-2, **SHORT) as optimizer:
        _train(negated, optimizer, batches, sign=-1.0)
    assert_weights_equal(weights(model), weights(negated))


def test_a_non_contiguous_parameter_is_refused_with_the_fix() -> None:
    transposed = nn.Parameter(torch.randn(6, 4).t())
    with ZenFlowAdamW([transposed], **DEVICE_ONLY) as optimizer:
        transposed.grad = torch.ones_like(transposed)
        with pytest.raises(ValueError, match=r"not contiguous.*param\.data = param\.data\.contiguous\(\)"):
            optimizer.step()
    transposed.data = transposed.data.contiguous()
    before = transposed.detach().clone()
    with ZenFlowAdamW([transposed], **DEVICE_ONLY) as optimizer:
        optimizer.step()
    assert not torch.equal(transposed.detach(), before)


# ----------------------------------------------------------------------------- 5. subclasses
def test_a_subclass_that_presets_knobs_runs_when_it_is_the_first_instance(tmp_path) -> None:
    """torch wraps ``step`` in its profiling hook at a class's first instance and stores the wrapper on that class: a
    subclass built before any plain ZenFlowAdamW holds a wrapper of ZenFlowAdamW's own step. It is accepted (and
    equals AdamW); a subclass that really overrides ``step`` is still refused, by name. A fresh process: here a
    ZenFlowAdamW was built already."""
    script = tmp_path / "subclass.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from lightning_zenflow import ZenFlowAdamW
            from lightning_zenflow.engine.errors import UnsupportedSetupError

            class DeviceOnly(ZenFlowAdamW):
                def __init__(self, params, **kwargs):
                    super().__init__(params, topk_ratio=1.0, full_warm_up_rounds=0, **kwargs)

            class OwnStep(ZenFlowAdamW):
                def step(self, closure=None):
                    return super().step(closure)

            torch.manual_seed(0)
            model, control = torch.nn.Linear(8, 4), torch.nn.Linear(8, 4)
            control.load_state_dict(model.state_dict())
            with DeviceOnly(model.parameters(), lr=1e-2) as optimizer:
                assert "step" in vars(DeviceOnly), "torch stored its wrapper on the subclass"
                plain = torch.optim.AdamW(control.parameters(), lr=1e-2)
                for each, net in ((optimizer, model), (plain, control)):
                    for _ in range(3):
                        net(torch.ones(2, 8)).square().sum().backward()
                        each.step()
                        each.zero_grad()
            torch.testing.assert_close(model.weight, control.weight, atol=1e-6, rtol=0)
            with OwnStep(model.parameters()) as optimizer:
                model(torch.ones(2, 8)).sum().backward()
                try:
                    optimizer.step()
                except UnsupportedSetupError as error:
                    print("refused:", error)
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: __main__.OwnStep overrides step of ZenFlowAdamW" in done.stdout
    assert "register_step_pre_hook" in done.stdout


def test_a_subclass_that_overrides_step_is_refused_in_this_process_too() -> None:
    class OwnStateDict(ZenFlowAdamW):
        def state_dict(self):  # noqa: ANN202
            return super().state_dict()

    model = _model()
    with OwnStateDict(model.parameters(), **DEVICE_ONLY) as optimizer:
        model(torch.ones(2, 8)).sum().backward()
        with pytest.raises(UnsupportedSetupError, match="OwnStateDict overrides state_dict of ZenFlowAdamW"):
            optimizer.step()


def test_repr_shows_what_the_constructor_takes() -> None:
    """torch's listing of the param groups, then the ZenFlow knobs as keywords of the constructor, and none of the
    Trainer's knobs (``sync_on``, ``log_telemetry``, ``checkpoint_format``), which it refuses."""
    import inspect

    optimizer = ZenFlowAdamW(_model().parameters(), lr=1e-2, topk_ratio=0.2, steps_per_epoch=7)
    text = repr(optimizer)
    assert text.startswith("ZenFlowAdamW (\nParameter Group 0\n")
    knobs_line = next(line for line in text.splitlines() if line.startswith("ZenFlow: "))
    given = dict(item.split("=", 1) for item in knobs_line.removeprefix("ZenFlow: ").split(", "))
    accepted = set(inspect.signature(ZenFlowAdamW).parameters)
    assert set(given) <= accepted, set(given) - accepted
    assert given["topk_ratio"] == "0.2"
    assert given["steps_per_epoch"] == "7"
    assert not {"sync_on", "log_telemetry", "checkpoint_format"} & set(given)
    optimizer.close()
