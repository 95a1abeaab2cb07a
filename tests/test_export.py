"""The way back to AdamW (``engine/export.py``): the torch-format state states the host columns' moments at the exported
step, and a plain ``torch.optim.AdamW`` continues a ZenFlow run from it as well as ZenFlow continues itself (CPU)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_zenflow import ZenFlowAdamW
from lightning_zenflow.engine.export import adamw_state

pytestmark = pytest.mark.usefixtures("no_leaked_children")

BETAS = (0.9, 0.999)


def _entry(**changes: object) -> dict:
    generator = torch.Generator().manual_seed(0)
    entry = {
        "kind": "matrix",
        "exp_avg": torch.randn(3, 4, generator=generator),
        "exp_avg_sq": torch.rand(3, 4, generator=generator),
        "device_step": 20,
        "host_step": 8,
        "selected": torch.tensor([1]),
    }
    entry.update(changes)
    return entry


def test_the_host_columns_are_stated_at_the_exported_step() -> None:
    """AdamW's bias-corrected moments of every column are the ones its side had: the host columns' moments are
    rescaled from their own count (8) to the exported step (20); the device column is AdamW's already."""
    entry = _entry()
    state = adamw_state(entry, BETAS)
    assert float(state["step"]) == 20.0
    host = [0, 2, 3]
    for key, beta in (("exp_avg", BETAS[0]), ("exp_avg_sq", BETAS[1])):
        exported, saved = state[key], entry[key]
        torch.testing.assert_close(exported[:, host] / (1 - beta**20), saved[:, host] / (1 - beta**8))
        assert torch.equal(exported[:, 1], saved[:, 1])
    assert not torch.equal(state["exp_avg_sq"], entry["exp_avg_sq"]), "the entry is left as it was"


def test_the_interim_statistics_set_the_host_second_moment_to_the_single_step_one() -> None:
    entry = _entry(interim_row=torch.full((3,), 0.5), interim_decay=torch.tensor(0.75))
    state = adamw_state(entry, BETAS)
    host_v = state["exp_avg_sq"][:, [0, 2, 3]] / (1 - BETAS[1] ** 20)
    torch.testing.assert_close(host_v.mean(), torch.tensor(0.5 / (1 - 0.75)))


def test_the_warm_up_record_keeps_its_share_of_the_second_moment() -> None:
    """AdamW's second moment at step 20 after a warm-up of 12 steps: the warm-up's (per host column) decayed over the
    8 steps since, and the single-step mean square of the statistics for the rest."""
    warm_col = torch.tensor([3.0, 100.0, 5.0, 7.0])  # column 1 is on the device: not part of the host mean
    entry = _entry(
        interim_row=torch.full((3,), 0.5),
        interim_decay=torch.tensor(0.75),
        interim_warm_col=warm_col,
        interim_warm_steps=torch.tensor(12.0),
    )
    state = adamw_state(entry, BETAS)
    expected = BETAS[1] ** 8 * 5.0 + (1 - BETAS[1] ** 8) * 0.5 / (1 - 0.75)
    torch.testing.assert_close(state["exp_avg_sq"][:, [0, 2, 3]].double().mean(), torch.tensor(expected).double())
    no_record = adamw_state({**entry, "interim_warm_steps": torch.tensor(0.0)}, BETAS)
    torch.testing.assert_close(
        no_record["exp_avg_sq"][:, [0, 2, 3]].mean(),
        adamw_state({**entry, "interim_warm_col": None}, BETAS)["exp_avg_sq"][:, [0, 2, 3]].mean(),
    )


@pytest.mark.parametrize("beta2", [0.999, 0.95])
def test_the_warm_up_record_is_adamws_second_moment_at_the_end_of_the_warm_up(beta2: float) -> None:
    """After the warm-up (plain AdamW on every column), each matrix's record is AdamW's ``exp_avg_sq`` averaged over
    the rows, per column, to float rounding (with the exact host state the two runs take the same steps); it holds
    still after the warm-up."""
    batches = _data(0, 8)
    adamw_model = _model()
    adamw = torch.optim.AdamW(adamw_model.parameters(), lr=1e-2, betas=(0.9, beta2), weight_decay=0.0)
    _train(adamw_model, adamw, batches[:6])
    model = _model()
    with ZenFlowAdamW(
        model.parameters(),
        lr=1e-2,
        betas=(0.9, beta2),
        weight_decay=0.0,
        topk_ratio=0.25,
        full_warm_up_rounds=6,
        host_state="fp32",
    ) as zenflow:
        _train(model, zenflow, batches[:6])
        zenflow.flush()
        at_warm_up_end = zenflow.engine.state_dict()["params"]
        _train(model, zenflow, batches[6:])
        zenflow.flush()
        later = zenflow.engine.state_dict()["params"]
    for position in (0, 2):  # the matrices
        entry = at_warm_up_end[f"group0.param{position}"]
        expected = adamw.state_dict()["state"][position]["exp_avg_sq"].mean(0)
        torch.testing.assert_close(entry["interim_warm_col"], expected, rtol=1e-5, atol=0)
        assert float(entry["interim_warm_steps"]) == 6.0
        assert torch.equal(later[f"group0.param{position}"]["interim_warm_col"], entry["interim_warm_col"])


def test_moments_that_overflowed_are_exported_and_restored_without_an_error() -> None:
    """An infinite second moment (an overflow the run went on with): the single-step scale is left out, and the
    engine's moments still come back bitwise."""
    from lightning_zenflow.engine.export import exact_inverse, restore_moments

    exp_avg_sq = torch.rand(3, 4)
    exp_avg_sq[0, 0] = float("inf")
    entry = _entry(exp_avg_sq=exp_avg_sq, interim_row=torch.full((3,), 0.5), interim_decay=torch.tensor(0.75))
    state = adamw_state(entry, BETAS)
    restored = restore_moments(dict(state), {**entry, **exact_inverse(entry, BETAS)})
    assert torch.equal(restored["exp_avg"], entry["exp_avg"])
    assert torch.equal(restored["exp_avg_sq"], entry["exp_avg_sq"])


@pytest.mark.parametrize(
    "changes",
    [{"host_step": 20}, {"selected": torch.arange(4)}, {"kind": "device", "host_step": 0}],
    ids=["host_counts_every_step", "every_column_on_the_device", "device_only_parameter"],
)
def test_what_is_adamws_already_is_exported_as_it_is(changes: dict) -> None:
    entry = _entry(**changes)
    state = adamw_state(entry, BETAS)
    assert torch.equal(state["exp_avg"], entry["exp_avg"])
    assert torch.equal(state["exp_avg_sq"], entry["exp_avg_sq"])


# ------------------------------------------------------------------------ a continuation under plain AdamW
def _data(seed: int, batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    teacher = torch.randn(24, 8, generator=generator)
    out = []
    for _ in range(batches):
        inputs = torch.randn(16, 24, generator=generator)
        out.append((inputs, torch.tanh(inputs @ teacher) + 0.3 * torch.randn(16, 8, generator=generator)))
    return out


def _model() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(24, 64), nn.Tanh(), nn.Linear(64, 8))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, batches) -> None:
    for inputs, targets in batches:
        nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


@torch.no_grad()
def _heldout(model: nn.Module, batches) -> float:
    return sum(float(nn.functional.mse_loss(model(x), y)) for x, y in batches) / len(batches)


def _adamw(model: nn.Module) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.0)


def test_plain_adamw_continues_a_zenflow_state_as_well_as_zenflow_does() -> None:
    """ZenFlow trains 120 steps (defaults but a quarter of the columns on the device), flushes and exports. The
    exported second moment is within [0.8, 1.25] of what AdamW holds at the same step on the same data, per matrix
    (the export as it was, moments as merged at step = the optimizer step, held under half of it). Then 60 more steps
    from the same weights: plain AdamW from the export ends no more than 0.5 % above ZenFlow continuing its own state
    (held-out loss)."""
    train, later, heldout = _data(0, 120), _data(1, 60), _data(2, 8)
    adamw_model = _model()
    adamw = _adamw(adamw_model)
    _train(adamw_model, adamw, train)
    model = _model()
    zenflow = ZenFlowAdamW(model.parameters(), lr=1e-2, betas=BETAS, weight_decay=0.0, topk_ratio=0.25)
    _train(model, zenflow, train)
    zenflow.flush()
    exported = copy.deepcopy(zenflow.state_dict())
    merged = zenflow.engine.state_dict(include_moments=True)["params"]
    at_export = copy.deepcopy(model.state_dict())
    uncorrected = {
        position: {
            "step": torch.tensor(float(max(entry["device_step"], entry["host_step"]))),
            "exp_avg": entry["exp_avg"],
            "exp_avg_sq": entry["exp_avg_sq"],
        }
        for position, entry in enumerate(merged[f"group0.param{i}"] for i in range(4))
    }
    for position in (0, 2):  # the matrices
        adamws = adamw.state_dict()["state"][position]["exp_avg_sq"].sum()
        ratio = float(exported["state"][position]["exp_avg_sq"].sum() / adamws)
        assert 0.8 <= ratio <= 1.25, (position, ratio)
        before = float(uncorrected[position]["exp_avg_sq"].sum() / adamws)
        assert before < 0.5, (position, before)  # what the export was: a fraction of AdamW's
    _train(model, zenflow, later)
    zenflow.flush()
    zenflow.close()
    zenflow_own = _heldout(model, heldout)

    def adamw_from(state: dict) -> float:
        continued = _model()
        continued.load_state_dict(at_export)
        optimizer = _adamw(continued)
        optimizer.load_state_dict({"state": state, "param_groups": optimizer.state_dict()["param_groups"]})
        _train(continued, optimizer, later)
        return _heldout(continued, heldout)

    from_export = adamw_from(exported["state"])
    assert from_export <= zenflow_own * 1.005, (from_export, zenflow_own)
