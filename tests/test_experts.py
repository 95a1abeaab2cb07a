"""Mixture-of-experts weights as matrices of input channels (``lightning_zenflow/matrices.py``): the layout of each 3-D
expert parameter from transformers' own declaration or the ``expert_layouts`` knob, the engine's ``[E x out, in]``
view, the state keyed by that view, and the degenerate settings with such parameters (some experts reached by no
sample in a step) equal to AdamW in the exact state: one device, data parallel and FSDP2."""

from __future__ import annotations

import pytest
import torch
from ddp_script import Experts
from lightning_helpers import assert_weights_close, assert_weights_equal
from test_lightning_ddp import Fits
from test_lightning_fsdp import _options
from torch import nn

from lightning_zenflow import ZenFlowAdamW
from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.notices import ZenFlowNotice
from lightning_zenflow.matrices import matrix_columns

pytestmark = pytest.mark.usefixtures("no_leaked_children")


class _Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = nn.Linear(8, 4, bias=False)  # a 2-D [experts, hidden] weight, as a router's
        self.inp = nn.Linear(8, 8)
        self.experts = Experts(experts=4, features=8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.inp(x))
        return self.head(self.experts(hidden + self.router(hidden).sum(1, keepdim=True)))


class _Stack(nn.Module):
    """A user's own stack of matrices, declared by nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Parameter(torch.randn(3, 5, 7))


# ------------------------------------------------------------------------------------------------ the layouts
def test_transformers_experts_say_their_layout() -> None:
    """Qwen3-MoE's experts are ``[E, 2 x inter, hidden]`` and ``[E, hidden, inter]`` with ``F.linear``: their
    columns are the input channels (hidden, inter); GPT-OSS's are ``[E, in, out]`` (bmm): the view's columns are the
    last dimension; routers and other 2-D weights keep the default view."""
    transformers = pytest.importorskip("transformers")
    qwen = transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=32,
            moe_intermediate_size=12,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
        )
    )
    columns = matrix_columns(qwen)
    assert columns == {"model.layers.0.mlp.experts.gate_up_proj": 16, "model.layers.0.mlp.experts.down_proj": 12}
    oss = transformers.GptOssForCausalLM(
        transformers.GptOssConfig(
            vocab_size=64,
            hidden_size=16,
            intermediate_size=12,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["full_attention"],
        )
    )
    columns = matrix_columns(oss)
    assert columns == {"model.layers.0.mlp.experts.gate_up_proj": 24, "model.layers.0.mlp.experts.down_proj": 16}


def test_a_layout_nobody_declares_keeps_the_default_view_said_once_and_the_knob_names_it() -> None:
    stack = _Stack()
    with pytest.warns(ZenFlowNotice, match="expert_layouts"):
        assert matrix_columns(stack) == {}
    assert matrix_columns(stack, {"_Stack": "out_in"}) == {"blocks": 7}  # by module class
    assert matrix_columns(stack, {"block*": "in_out"}) == {"blocks": 7}  # by parameter pattern
    conv = nn.Sequential(nn.Conv2d(2, 3, 3))
    assert matrix_columns(conv) == {}  # a convolution's [out, in, k, k]: its input features are its columns


def test_a_wrong_layout_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="'out_in' for experts stored"):
        ZenFlowConfig(expert_layouts={"Experts": "rows"})


def test_the_engine_views_a_stack_of_experts_as_rows_of_every_expert_by_input_channels() -> None:
    model = _Router()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    names = {param: name for name, param in model.named_parameters()}
    with ZenFlowEngine(opt, ZenFlowConfig(), param_names=names, matrix_columns=matrix_columns(model)) as engine:
        slots = {slot.name: slot for group in engine.layout for slot in group.matrices}
        assert (slots["experts.weight"].rows, slots["experts.weight"].cols) == (4 * 8, 8)
        assert (slots["router.weight"].rows, slots["router.weight"].cols) == (4, 8)
    facade = ZenFlowAdamW(model.parameters(), lr=1e-2, model=model)
    try:
        facade.step()  # no gradients: starts nothing
        model(torch.randn(5, 8)).sum().backward()
        facade.step()
        slots = {slot.name: slot for group in facade.engine.layout for slot in group.matrices}
        assert slots["group0.param3"].cols == 8  # positional names (experts.weight); the model said the layout
    finally:
        facade.close()


# ------------------------------------------------------------------------------------ degenerate: one device
EXACT = {
    "all_columns": {"topk_ratio": 1.0, "update_interval": 3},
    "synchronous_offload": {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False},
}


@pytest.mark.parametrize("knobs", list(EXACT.values()), ids=list(EXACT))
def test_degenerate_settings_with_experts_equal_adamw_on_one_device(knobs: dict) -> None:
    """A weight-dependent loss over 10 steps in which some experts get no sample (their gradient slice is zero and
    AdamW still moves them by momentum and decay): the engine in the exact state is AdamW."""
    generator = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 8, generator=generator), torch.randn(6, 3, generator=generator)) for _ in range(10)]
    reference, model = _Router(), _Router()
    torch_opt = torch.optim.AdamW(reference.parameters(), lr=2e-2, weight_decay=0.1)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.1)
    config = ZenFlowConfig(full_warm_up_rounds=0, host_state="fp32", **knobs)
    names = {param: name for name, param in model.named_parameters()}
    unreached = 0
    with ZenFlowEngine(opt, config, param_names=names, matrix_columns=matrix_columns(model)) as engine:
        for x, y in batches:
            engine.wait_for_update()
            nn.functional.mse_loss(model(x), y).backward()
            unreached += int((model.experts.weight.grad.flatten(1).abs().sum(1) == 0).sum())
            engine.step()
            opt.zero_grad()
            nn.functional.mse_loss(reference(x), y).backward()
            torch_opt.step()
            torch_opt.zero_grad()
        engine.flush()
        engine.wait_for_update()
    assert unreached > 0, "some expert must go a step without a sample"
    for (name, expected), actual in zip(reference.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5, msg=name)


# ---------------------------------------------------------------------- degenerate: data parallel and FSDP2
@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Fits:
    fits = Fits(tmp_path_factory.mktemp("expert_fits"))
    exact = {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}
    fits.plan(
        *(_options(2, fsdp=fsdp, strategy=knobs, experts=True) for fsdp in (True, False) for knobs in (exact, "adamw"))
    )
    return fits


@pytest.mark.slow  # four 2-rank fits (about a minute); the one-device test above covers the rule itself
@pytest.mark.parametrize("fsdp", [True, False], ids=["fsdp2", "data_parallel"])
def test_synchronous_offload_with_experts_equals_adamw_across_ranks(fits: Fits, fsdp: bool) -> None:
    exact = {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}
    zenflow = fits.get(**_options(2, fsdp=fsdp, strategy=exact, experts=True))
    adamw = fits.get(**_options(2, fsdp=fsdp, strategy="adamw", experts=True))
    assert zenflow[0]["strategy"] == ("ZenFlowFSDPStrategy" if fsdp else "ZenFlowDDPStrategy")
    assert_weights_close(zenflow[0]["weights"], adamw[0]["weights"], atol=1e-6, rtol=0.0)
    assert_weights_equal(zenflow[1]["weights"], zenflow[0]["weights"])
