"""The planner on mixtures of experts: a step's forward and backward FLOPs count the parameters one token runs through
(its router's experts, the attention, the router, shared experts, dense layers), while the memory, the optimizer's
step and the host's bytes count every expert. Qwen3-30B-A3B (30.53 B parameters, 3.35 B active) on 8 x 80 GB is priced
like a dense 3 B model, not like a dense 30 B one; an architecture without a routing rule is refused with the fix.
Everything is built on the meta device from configs (a few seconds in all)."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from lightning_zenflow import plan
from lightning_zenflow.cli import main
from lightning_zenflow.planner import PlanError
from lightning_zenflow.planner.costs import FSDP_OFFLOAD_HOST_BYTES, ZERO3_HOST_BYTES
from lightning_zenflow.planner.experts import EXPERT_RULES, ExpertRule
from lightning_zenflow.planner.shapes import engine_shapes, shapes_from_source

transformers = pytest.importorskip("transformers", reason="model sources need `pip install '.[llm]'`")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("the expert rules are for transformers 5's fused experts", allow_module_level=True)

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
EIGHT_GPUS = {"device_memory": "80GB", "host_memory": "1TB", "devices": 8}
"""``lightning-zenflow plan --devices 8 --device-memory 80GB --host-memory 1TB``: the batch at its default, 8 x 1024."""
SMALL_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 128,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "decoder_sparse_step": 2,
    "mlp_only_layers": [3],
    "tie_word_embeddings": False,
}
"""Four layers: layer 1 sparse ((1 + 1) % 2 == 0), layer 3 would be but is in ``mlp_only_layers``, 0 and 2 dense."""


def small_qwen3_moe_by_hand() -> tuple[int, int]:
    """(every parameter, the parameters one token runs through) of :data:`SMALL_QWEN3_MOE`, counted from its numbers."""
    c = SMALL_QWEN3_MOE
    hidden, vocab = c["hidden_size"], c["vocab_size"]
    query = c["num_attention_heads"] * c["head_dim"]
    key_value = c["num_key_value_heads"] * c["head_dim"]
    attention = hidden * query + 2 * hidden * key_value + query * hidden + 2 * c["head_dim"]  # q, k, v, o; q, k norms
    norms = 2 * hidden
    dense_mlp = 3 * hidden * c["intermediate_size"]  # gate, up, down
    router = c["num_experts"] * hidden
    one_expert = 3 * hidden * c["moe_intermediate_size"]
    sparse = [i for i in range(4) if (i + 1) % c["decoder_sparse_step"] == 0 and i not in c["mlp_only_layers"]]
    assert sparse == [1]
    outside = 2 * vocab * hidden + hidden  # embedding, output layer, final norm
    every = outside + 4 * (attention + norms) + 3 * dense_mlp + router + c["num_experts"] * one_expert
    active = outside + 4 * (attention + norms) + 3 * dense_mlp + router + c["num_experts_per_tok"] * one_expert
    return every, active


def write_config(folder: pathlib.Path, config: dict) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder / "config.json")


@pytest.fixture(scope="module")
def on_eight_gpus() -> dict:
    return {name: plan(str(MODELS / f"{name}.json"), **EIGHT_GPUS) for name in ("Qwen3-30B-A3B", "Qwen2.5-3B")}


def test_the_active_parameters_of_a_small_qwen3_moe_are_the_ones_counted_by_hand(tmp_path: pathlib.Path) -> None:
    """Two of eight experts in the one sparse layer, every dense layer and the router whole: the FLOPs follow them."""
    every, active = small_qwen3_moe_by_hand()
    source = write_config(tmp_path / "small", SMALL_QWEN3_MOE)
    shapes = shapes_from_source(source, torch.bfloat16)
    assert shapes.parameters == every
    assert shapes.active_parameters == active
    assert shapes.routing.describe() == "2 of 8 experts per token"
    result = plan(source, device_memory="80GB", host_memory="64GB", batch_size=2, block_size=16)
    assert (result.parameters, result.active_parameters) == (every, active)
    tokens, width, layers = 2 * 16, 4 * 16, 4
    flops = 6 * active * tokens + 6 * layers * 16 * width * tokens  # the attention is heads x head_dim wide
    assert result.rows[0].times["fwd_bwd"] == pytest.approx(flops / 400e12)


def test_memory_counts_every_expert(tmp_path: pathlib.Path) -> None:
    """The weights, the gradients, plain AdamW's state, the engine's matrices and the peers' host state are those of all
    eight experts, not of the two a token runs through."""
    every, _ = small_qwen3_moe_by_hand()
    source = write_config(tmp_path / "small", SMALL_QWEN3_MOE)
    result = plan(source, device_memory="80GB", host_memory="64GB", devices=2, batch_size=2, block_size=16)
    adamw = result.row("adamw ddp")
    assert adamw.device["weights"] == adamw.device["gradients"] == 4 * every
    assert adamw.device["optimizer"] == 8 * every
    assert result.row("zenflow ddp").device["weights"] == 2 * every
    assert result.row("peer: fsdp2 CPUOffloadPolicy").host["engine"] == FSDP_OFFLOAD_HOST_BYTES * every
    assert result.row("peer: deepspeed zero3 offload").host["engine"] == ZERO3_HOST_BYTES * every
    shapes = shapes_from_source(source, torch.bfloat16)
    matrices, vectors = engine_shapes(shapes, 2, "single")
    assert sum(m.rows * m.cols for m in matrices) + sum(v.numel for v in vectors) == every
    # the experts' fused [experts, out, in] parameters are the engine's matrices [experts x out, in]: every expert's
    # output channels as rows, the input channels they share as columns (lightning_zenflow/matrices.py)
    experts, hidden, inter = (SMALL_QWEN3_MOE[k] for k in ("num_experts", "hidden_size", "moe_intermediate_size"))
    shapes_seen = {(m.rows, m.cols) for m in matrices}
    assert (experts * 2 * inter, hidden) in shapes_seen  # gate_up_proj [E, 2 x inter, hidden]
    assert (experts * hidden, inter) in shapes_seen  # down_proj [E, hidden, inter]


def test_qwen3_30b_a3b_has_30_53_b_parameters_of_which_3_35_b_run_per_token() -> None:
    """The published counts (30.5 B, 3.3 B activated), from the shipped config.json by hand: 48 sparse layers of 128
    experts, 8 per token, untied embeddings."""
    config = json.loads((MODELS / "Qwen3-30B-A3B.json").read_text())
    hidden, heads, kv, head = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"], 128
    attention = 2 * hidden * heads * head + 2 * hidden * kv * head + 2 * head
    one_expert = 3 * hidden * config["moe_intermediate_size"]
    layer = attention + 2 * hidden + config["num_experts"] * hidden  # norms, router
    outside = 2 * config["vocab_size"] * hidden + hidden
    every = outside + 48 * (layer + config["num_experts"] * one_expert)
    active = outside + 48 * (layer + config["num_experts_per_tok"] * one_expert)
    shapes = shapes_from_source(str(MODELS / "Qwen3-30B-A3B.json"), torch.bfloat16)
    assert shapes.parameters == every == 30_532_122_624
    assert shapes.active_parameters == active == 3_353_032_704
    assert type(shapes.model).__name__ == "Qwen3MoeForCausalLM"


def test_gpt_oss_20b_has_20_91_b_parameters_and_its_experts_are_recognised() -> None:
    """GPT-OSS holds its experts ``[experts, in, out]`` with biases ``[experts, out]``: the first dimension is the
    expert all the same. 4 of 32 experts per token; attention with biases and sinks."""
    config = json.loads((MODELS / "GPT-OSS-20B.json").read_text())
    hidden, inter, experts = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    query, key_value = 64 * 64, 8 * 64
    attention = hidden * query + query + 2 * (hidden * key_value + key_value) + query * hidden + hidden + 64
    one_expert = hidden * 2 * inter + 2 * inter + inter * hidden + hidden
    layer = attention + 2 * hidden + experts * hidden + experts  # norms, router with its bias
    outside = 2 * config["vocab_size"] * hidden + hidden
    shapes = shapes_from_source(str(MODELS / "GPT-OSS-20B.json"), torch.bfloat16)
    assert shapes.parameters == outside + 24 * (layer + experts * one_expert) == 20_914_757_184
    assert shapes.active_parameters == outside + 24 * (layer + config["num_experts_per_tok"] * one_expert)
    assert shapes.routing.describe() == "4 of 32 experts per token"


def test_on_8_gpus_qwen3_30b_a3b_steps_like_a_3b_model_not_like_a_30b_one(on_eight_gpus: dict) -> None:
    """Plain AdamW's step against Qwen2.5-3B (3.09 B, dense) on the same machine and batch: 9.7x when every expert's
    FLOPs were priced, now within 2x (the optimizer's step still updates all 30.5 B parameters). ZenFlow's host step,
    30.5 B parameters per window behind the compute of 3.35 B, is no longer hidden at S = 4."""
    moe, dense = on_eight_gpus["Qwen3-30B-A3B"], on_eight_gpus["Qwen2.5-3B"]
    for name in ("adamw ddp", "adamw fsdp2"):
        assert moe.row(name).step_s <= 2 * dense.row(name).step_s, name
    compute = moe.row("adamw ddp").times["fwd_bwd"] / dense.row("adamw ddp").times["fwd_bwd"]
    assert compute == pytest.approx(moe.active_parameters / dense.parameters, rel=0.05)
    zenflow = moe.row("zenflow fsdp2")
    assert zenflow.accumulate_on == "device"
    assert zenflow.interval_needed > 8
    assert zenflow.times["worker"] > 4 * zenflow.times["fwd_bwd"]
    assert "3.353 B active: 8 of 128 experts per token" in moe.table()
    assert "No expert parallelism" in moe.table()
    assert moe.to_json()["active_parameters"] == 3_353_032_704


def test_what_fits_one_h200_and_8_gpus() -> None:
    """With activation checkpointing and 8 x 1024 tokens per rank: on one H200 the bf16 weights and gradients of
    30.5 B parameters (4 B each, 122 GB) leave too little for ZenFlow's default device state (16 rho = 1.6 B per
    parameter, 49 GB), but at topk_ratio=0.01 (5 GB) it fits and steps in half synchronous offload's time; on 8 x 80 GB
    FSDP2 divides them by 8 and ZenFlow's defaults fit. GPT-OSS-20B (84 GB of weights and gradients) fits one H200 with
    ZenFlow's defaults."""
    h200 = {"device_memory": "141GB", "host_memory": "1TB", "activation_checkpointing": True}
    eight = {**EIGHT_GPUS, "activation_checkpointing": True}
    qwen_one = plan(str(MODELS / "Qwen3-30B-A3B.json"), **h200)
    assert not qwen_one.row("zenflow").fits
    assert qwen_one.row("zenflow").limit == "device"
    assert qwen_one.recommended.name == "zenflow topk_ratio=0.01"
    assert qwen_one.recommended.step_s < qwen_one.row("sync-offload").step_s / 2
    qwen_eight = plan(str(MODELS / "Qwen3-30B-A3B.json"), **eight)
    assert qwen_eight.recommended.name == "zenflow fsdp2"
    assert qwen_eight.recommended.step_s < qwen_eight.row("sync-offload fsdp2").step_s / 20
    gpt_one = plan(str(MODELS / "GPT-OSS-20B.json"), **h200)
    assert gpt_one.recommended.name == "zenflow"
    assert gpt_one.recommended.step_s < gpt_one.row("sync-offload").step_s
    assert plan(str(MODELS / "GPT-OSS-20B.json"), **eight).recommended.name == "zenflow fsdp2"


SMALL = {
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
KNOWN = {
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "mlp_only_layers": [2]},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24,
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"num_local_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
    "deepseek_v3": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
        "first_k_dense_replace": 1,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "q_lora_rank": 16,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 8,
        "num_key_value_heads": 4,
    },
}


def test_every_rule_has_a_small_model_here() -> None:
    assert set(KNOWN) == set(EXPERT_RULES)


@pytest.mark.parametrize("model_type", sorted(KNOWN))
def test_each_known_mixture_builds_and_a_token_runs_through_k_of_its_experts(
    model_type: str, tmp_path: pathlib.Path
) -> None:
    """Built on meta, its activations estimated (the experts run as grouped_mm, the meta device's way), and of the
    parameters under ``mlp.experts`` 2 of 4 experts' share counted: shared experts, dense layers and routers whole."""
    config = transformers.CONFIG_MAPPING[model_type](**{**SMALL, **KNOWN[model_type]})
    config.save_pretrained(tmp_path / model_type)
    result = plan(str(tmp_path / model_type), device_memory="80GB", host_memory="64GB", batch_size=2, block_size=16)
    shapes = shapes_from_source(str(tmp_path / model_type), torch.bfloat16)
    routed = sum(p.numel for p in shapes.params if ".mlp.experts." in p.name)
    assert routed > 0
    assert result.parameters == sum(p.numel for p in shapes.params)
    assert result.active_parameters == result.parameters - routed + routed * 2 // 4
    assert result.routing == "2 of 4 experts per token"
    assert result.activations > 0


def test_planning_a_live_model_leaves_its_attention_and_experts_as_they_were() -> None:
    """The estimate runs on a copy of the structure with the planner's attention and grouped experts: the user's
    model keeps its own (``from_config`` sets them on the config it is handed)."""
    config = transformers.CONFIG_MAPPING["qwen3_moe"](**{**SMALL, **KNOWN["qwen3_moe"]})
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa", experts_implementation="eager"
    )
    result = plan(model, device_memory="80GB", host_memory="64GB", batch_size=2, block_size=16)
    assert result.activations > 0
    assert result.routing == "2 of 4 experts per token"
    assert model.config._attn_implementation == "sdpa"
    assert model.config._experts_implementation == "eager"


def test_a_mixture_of_experts_without_a_rule_is_refused_with_the_fix(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture
) -> None:
    """GraniteMoE routes tokens (its config says so) and has no rule: its FLOPs cannot be counted, so the plan names
    --fwd-bwd-s and the rules' home; with a measured forward and backward it plans, every expert in its memory."""
    config = transformers.CONFIG_MAPPING["granitemoe"](**SMALL, num_local_experts=4, num_experts_per_tok=2)
    config.save_pretrained(tmp_path / "granitemoe")
    source = str(tmp_path / "granitemoe")
    with pytest.raises(PlanError, match=r"granitemoe .*no rule.*--fwd-bwd-s SECONDS.*EXPERT_RULES"):
        plan(source, device_memory="80GB", host_memory="64GB")
    assert main(["plan", "--model", source, "--device-memory", "80GB", "--host-memory", "64GB"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: --model ")
    assert "--fwd-bwd-s" in error
    measured = plan(source, device_memory="80GB", host_memory="64GB", batch_size=2, block_size=16, fwd_bwd_s=0.5)
    assert measured.active_parameters is None
    assert measured.row("adamw").times["fwd_bwd"] == 0.5
    assert measured.row("adamw").device["weights"] == 4 * measured.parameters


def test_experts_in_another_layout_than_the_rule_expects_are_refused(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule whose expert count does not match the first dimension of the experts' parameters (another transformers'
    layout) is refused, not guessed."""
    source = write_config(tmp_path / "small", SMALL_QWEN3_MOE)
    monkeypatch.setitem(EXPERT_RULES, "qwen3_moe", ExpertRule("num_attention_heads"))
    with pytest.raises(PlanError, match=r"not fused along a first dimension of its 4 experts.*transformers>=5"):
        plan(source, device_memory="80GB", host_memory="64GB")
