"""``benchmarks/rule_optimizer.py`` (the optimizer of ``rule_variants.py``): its paper rule equals
``tests/reference.py``, and every candidate rule change keeps the degenerate cases that must equal
``torch.optim.AdamW`` (rho 1; rho 0, S 1, overlap off). CPU, a few seconds."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from reference import ReferenceZenFlow

from lightning_zenflow import ZenFlowConfig

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
from rule_optimizer import Rule, RuleOptimizer  # noqa: E402

SHAPES = {"embed": (12, 8), "fc": (10, 12), "conv": (6, 3, 2, 2), "fc_bias": (10,), "norm": (8,)}
STEPS = 14
SYNC_AT = (5, 11)
"""Steps after which both sides sync (the benchmark's evaluations)."""


def _build(seed: int) -> tuple[dict[str, torch.Tensor], torch.optim.AdamW]:
    generator = torch.Generator().manual_seed(seed)
    params = {name: torch.randn(shape, generator=generator).requires_grad_() for name, shape in SHAPES.items()}
    groups = [
        {"params": [p for p in params.values() if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params.values() if p.ndim < 2], "weight_decay": 0.0},
    ]
    return params, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)


def _drive(
    rule: Rule, seed: int, other: str | None, trajectory: list | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Run ``RuleOptimizer`` on one copy of the parameters and ``other`` ("reference", "adamw" or None: nothing) on
    another, with the same gradients and learning rates, checking they agree after every step; return both final
    weights (after a flush)."""
    params, opt = _build(seed)
    twin, twin_opt = _build(seed)
    ours = RuleOptimizer(opt.param_groups, rule)
    reference = None
    if other == "reference":
        config = ZenFlowConfig(
            topk_ratio=rule.ratio,
            update_interval=rule.interval,
            overlap_step=rule.overlap,
            full_warm_up_rounds=rule.warm_up,
            select_strategy="step" if rule.refresh == "sync" else "epoch",
            select_interval=rule.refresh_interval if rule.refresh == "sync" else 1,
            interim_step=0,  # the rule optimizer writes the paper's rule and its variants
            host_state="fp32",  # in fp32
        )
        reference = ReferenceZenFlow(twin_opt.param_groups, {p: n for n, p in twin.items()}, config)
    generator = torch.Generator().manual_seed(seed + 100)
    for t in range(1, STEPS + 1):
        for group in (*opt.param_groups, *twin_opt.param_groups):
            group["lr"] = 1e-2 * (1.0 + 0.5 * (t % 3))  # a schedule: hyperparameters are read at every step
        grads = {name: torch.randn(p.shape, generator=generator) * (1 + torch.arange(p.shape[-1])) for name, p in
                 params.items()}  # fmt: skip
        for name in params:
            params[name].grad = grads[name].clone()
            twin[name].grad = grads[name].clone()
        with torch.no_grad():
            ours.step()
            if reference is not None:
                reference.step(grads)
                for name, weight in reference.weights().items():
                    twin[name].data.copy_(weight)
            elif other == "adamw":
                twin_opt.step()
            if other is not None:
                ours_now = {n: p.detach() for n, p in params.items()}
                torch.testing.assert_close(ours_now, {n: p.detach() for n, p in twin.items()}, msg=f"step {t}")
            if trajectory is not None:
                trajectory.append(torch.cat([p.detach().flatten().clone() for p in params.values()]))
            if t in SYNC_AT:
                ours.sync()
                if reference is not None:
                    reference.sync()
                    for name, weight in reference.weights().items():
                        twin[name].data.copy_(weight)
    with torch.no_grad():
        ours.flush()
        if reference is not None:
            reference.flush()
            for name, weight in reference.weights().items():
                twin[name].data.copy_(weight)
    return {n: p.detach() for n, p in params.items()}, {n: p.detach() for n, p in twin.items()}


PAPER_RULES = [
    Rule(ratio=0.3, interval=3),
    Rule(ratio=0.3, interval=3, overlap=False, warm_up=2),
    Rule(ratio=0.5, interval=2, refresh="sync", refresh_interval=4),
    Rule(ratio=0.2, interval=3, warm_up=1, refresh="sync", refresh_interval=5),
    Rule(ratio=0.0, interval=1),
]


@pytest.mark.parametrize("rule", PAPER_RULES, ids=lambda r: f"rho{r.ratio}-S{r.interval}-{r.overlap}-{r.refresh}")
def test_paper_rule_equals_reference(rule: Rule) -> None:
    ours, reference = _drive(rule, seed=1, other="reference")
    torch.testing.assert_close(ours, reference)


VARIANTS = {
    "score-window": {"refresh": "window", "score": "window"},
    "score-ema": {"refresh": "window", "score": "ema"},
    "score-adam": {"refresh": "window", "score": "adam", "warm_up": 2},
    "adaptive": {"share": "adaptive", "refresh": "window"},
    "extrapolate": {"extrapolate": True, "refresh": "window"},
    "land-after": {"land_after": 1, "extrapolate": True},
    "matched-betas": {"matched_betas": True, "refresh": "window"},
    "matched-beta1": {"matched_beta1": True},
    "window-decay": {"window_decay": True},
    "warm-up-score": {"score": "window", "warm_up_score": True, "warm_up": 2},
    "overlap-after": {"overlap_after": 4, "refresh": "window"},
}


@pytest.mark.parametrize("knobs", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize(("ratio", "interval", "overlap"), [(1.0, 3, True), (0.0, 1, False)], ids=["rho1", "rho0-S1"])
def test_variant_degenerate_cases_equal_adamw(knobs: dict, ratio: float, interval: int, overlap: bool) -> None:
    if not overlap and "land_after" in knobs:
        knobs = {**knobs, "land_after": 0}
    ours, adamw = _drive(Rule(ratio=ratio, interval=interval, overlap=overlap, **knobs), seed=2, other="adamw")
    torch.testing.assert_close(ours, adamw)


def test_land_after_zero_is_overlap_off() -> None:
    """L = 0 lands each update at its own window end: the paper's rule with overlap off."""
    ours, _ = _drive(Rule(ratio=0.3, interval=3, land_after=0), seed=3, other=None)
    off, _ = _drive(Rule(ratio=0.3, interval=3, overlap=False), seed=3, other=None)
    torch.testing.assert_close(ours, off)


def test_overlap_after_past_the_run_is_overlap_off() -> None:
    """Windows that close at or before ``overlap_after`` land at once: past the last step, that is overlap off."""
    ours, _ = _drive(Rule(ratio=0.3, interval=3, overlap_after=10_000), seed=3, other=None)
    off, _ = _drive(Rule(ratio=0.3, interval=3, overlap=False), seed=3, other=None)
    torch.testing.assert_close(ours, off)


def test_host_lr_scale() -> None:
    """A scaled host step size changes nothing when every column is on the device (rho 1: AdamW), and changes the
    weights when the host updates some (it cannot keep the rho 0, S 1 case: that case is all host steps)."""
    ours, adamw = _drive(Rule(ratio=1.0, interval=3, host_lr_scale=2.0), seed=2, other="adamw")
    torch.testing.assert_close(ours, adamw)
    base: list[torch.Tensor] = []
    scaled: list[torch.Tensor] = []
    _drive(Rule(ratio=0.3, interval=3), seed=4, other=None, trajectory=base)
    _drive(Rule(ratio=0.3, interval=3, host_lr_scale=2.0), seed=4, other=None, trajectory=scaled)
    assert any(not torch.equal(a, b) for a, b in zip(base, scaled))


def test_warm_up_score_changes_the_first_selection_only_through_the_score() -> None:
    """The same warm-up with and without the warm-up's steps in the score: the weights differ (the first selection
    ranks by a different score), so the knob is not silently ignored."""
    plain: list[torch.Tensor] = []
    scored: list[torch.Tensor] = []
    _drive(Rule(ratio=0.3, interval=3, warm_up=2, score="window"), seed=5, other=None, trajectory=plain)
    _drive(Rule(ratio=0.3, interval=3, warm_up=2, score="window", warm_up_score=True), seed=5, other=None,
           trajectory=scored)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(plain[:2], scored[:2]))  # the warm-up itself is the same
    assert any(not torch.equal(a, b) for a, b in zip(plain, scored))


def test_bf16_device_moments() -> None:
    """bf16 device moments: nothing on the device at rho 0 (S 1, overlap off: AdamW exactly); at rho 1 every column
    is on the device and the weights follow AdamW to bf16 moment precision, not bit for bit."""
    ours, adamw = _drive(Rule(ratio=0.0, interval=1, overlap=False, device_moments="bf16"), seed=2, other="adamw")
    torch.testing.assert_close(ours, adamw)
    exact: list[torch.Tensor] = []
    rounded: list[torch.Tensor] = []
    _drive(Rule(ratio=1.0, interval=3), seed=4, other=None, trajectory=exact)
    _drive(Rule(ratio=1.0, interval=3, device_moments="bf16"), seed=4, other=None, trajectory=rounded)
    assert any(not torch.equal(a, b) for a, b in zip(exact, rounded))
    torch.testing.assert_close(rounded[-1], exact[-1], rtol=0.0, atol=1e-2)


def test_variants_change_the_numbers() -> None:
    """Each knob changes the weights the model shows away from the degenerate cases (a knob that silently did nothing
    would pass the tests above)."""
    base: list[torch.Tensor] = []
    _drive(Rule(ratio=0.3, interval=3), seed=4, other=None, trajectory=base)
    for name, knobs in VARIANTS.items():
        changed: list[torch.Tensor] = []
        _drive(Rule(ratio=0.3, interval=3, **knobs), seed=4, other=None, trajectory=changed)
        assert any(not torch.equal(a, b) for a, b in zip(base, changed)), name
