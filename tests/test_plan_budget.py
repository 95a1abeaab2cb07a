"""The planner's engine bytes are a running engine's, byte for byte: for the demo GPT, a tiny Llama with tied
embeddings and SmolLM2-135M's architecture (its config.json, random weights), in every setting the plan's rows use
(the compact and the exact host state, device and host accumulation, fp32 and bf16 weights, Adam's L2 decay), on one
device and on 2 ranks, data parallel (each rank its row block of the host state) and FSDP2 (each rank its row shards).

The planner's count (``lightning_zenflow.plan``'s rows: ``engine_device``, the largest rank, and ``engine_host``,
the first machine's ranks together) is compared with ``engine.device_bytes()`` and ``engine.host_bytes()`` after the
first selection and a landing. On a CPU there is no landing buffer (``engine/budget.py``). The 2-rank jobs include the
setting the plan recommends for Llama-3.1-70B on 8 x 80 GB (``topk_ratio=0.05`` in device mode under FSDP2)."""

from __future__ import annotations

import pathlib

import pytest
import torch
from distributed_helpers import run_ranks
from plan_ranks import STEPS, optimizer_of, run, tiny_llama

from lightning_zenflow import plan
from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.planner import Machine

transformers = pytest.importorskip("transformers", reason="the Llama models need `pip install '.[llm]'`")

pytestmark = pytest.mark.usefixtures("no_leaked_children")

ROOT = pathlib.Path(__file__).resolve().parents[1]
GIB = 2**30
SETTINGS = [
    pytest.param({"accumulate_on": "device"}, 0.0, False, id="defaults"),
    pytest.param({"accumulate_on": "device", "host_state": "fp32"}, 0.0, False, id="exact"),
    pytest.param({"accumulate_on": "host"}, 0.0, False, id="host-mode"),
    pytest.param({"accumulate_on": "host", "host_state": "fp32", "interim_step": 0}, 0.0, False, id="host-exact"),
    pytest.param({"accumulate_on": "device"}, 0.1, True, id="adam-l2"),
]


def cpu_machine(devices: int = 1) -> Machine:
    """The CPU stand-in: the 'device' is this machine's memory (no landing buffer)."""
    return Machine(device_type="cpu", device_memory=64 * GIB, host_memory=64 * GIB, devices=devices)


def planned(model: torch.nn.Module, dtype: torch.dtype, knobs: dict, decay: float, l2: bool, devices: int = 1):
    """The plan's rows for ``knobs`` (one device: the knobs' own row; 2: its data-parallel and FSDP2 rows)."""
    plan_knobs = {k: v for k, v in knobs.items() if k != "interim_step"}
    result = plan(
        model,
        machine=cpu_machine(devices),
        precision="32-true" if dtype == torch.float32 else "bf16-true",
        update_interval=2,
        weight_decay=decay,
        l2_decay=l2,
        batch_size=1,
        block_size=8,
        **plan_knobs,
    )
    if "interim_step" in knobs:  # the plan's rows keep interim_step="auto": evaluate this one as the engine runs it
        from lightning_zenflow.planner.costs import Setting, evaluate
        from lightning_zenflow.planner.shapes import shapes_of

        layouts = ("single",) if devices == 1 else ("ddp", "fsdp2")
        rows = {}
        for layout in layouts:
            setting = Setting("zenflow", "zenflow", layout, {**knobs, "update_interval": 2})
            rows[layout] = evaluate(shapes_of(model), setting, result.machine, result.workload, 0)
        return rows
    if devices == 1:
        return {"single": result.row("zenflow")}
    return {"ddp": result.row("zenflow ddp"), "fsdp2": result.row("zenflow fsdp2")}


def engine_bytes(model: torch.nn.Module, dtype: torch.dtype, knobs: dict, decay: float, l2: bool) -> tuple[int, int]:
    """A running engine's (device, host) bytes after a warm-up step, the first selection, a window and a landing."""
    params = list(model.parameters())
    optimizer = optimizer_of(params, decay, l2)
    config = ZenFlowConfig(full_warm_up_rounds=1, update_interval=2, **knobs)
    names = {p: n for n, p in model.named_parameters()}
    generator = torch.Generator().manual_seed(0)
    grads = {p: torch.randn(p.shape, generator=generator).to(dtype) for p in params}
    with ZenFlowEngine(optimizer, config, param_names=names) as engine:
        for _ in range(STEPS):
            for param in params:
                param.grad = grads[param]
            engine.step()
            engine.wait_for_update()
        assert engine.accumulate_on == knobs["accumulate_on"]
        return engine.device_bytes(), engine.host_bytes()


def demo_gpt(dtype: torch.dtype) -> torch.nn.Module:
    from lightning_zenflow.demo import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig()).to(dtype)


@pytest.mark.parametrize(("knobs", "decay", "l2"), SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("build", [demo_gpt, tiny_llama], ids=["demo-gpt", "tiny-llama"])
def test_one_device_the_plan_counts_what_the_engine_holds(build, dtype, knobs: dict, decay: float, l2: bool) -> None:
    model = build(dtype)
    row = planned(model, dtype, knobs, decay, l2)["single"]
    assert engine_bytes(model, dtype, knobs, decay, l2) == (row.engine_device, row.engine_host)


@pytest.mark.slow
def test_smollm2_135m_the_plan_counts_what_the_engine_holds() -> None:
    """SmolLM2-135M's architecture (configs/models/SmolLM2-135M.json: tied embeddings, 134.5 M parameters) in bf16
    with the defaults (the other settings are the small models' above: the same formulas, a minute less)."""
    knobs, dtype = {"accumulate_on": "device"}, torch.bfloat16
    config = transformers.AutoConfig.from_pretrained(ROOT / "configs" / "models" / "SmolLM2-135M.json")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # the embeddings once
    row = planned(model, dtype, knobs, 0.0, False)["single"]
    assert engine_bytes(model, dtype, knobs, 0.0, False) == (row.engine_device, row.engine_host)


TWO_RANK_JOBS = [
    {"knobs": {"accumulate_on": "device"}, "weight_decay": 0.0, "l2": False},
    {"knobs": {"accumulate_on": "device", "host_state": "fp32"}, "weight_decay": 0.0, "l2": False},
    {"knobs": {"accumulate_on": "host"}, "weight_decay": 0.0, "l2": False},
    {"knobs": {"accumulate_on": "device"}, "weight_decay": 0.1, "l2": True},
    # what the plan recommends for Llama-3.1-70B on 8 x 80 GB (configs/llm_70b.yaml): fewer columns on the device
    {"knobs": {"accumulate_on": "device", "topk_ratio": 0.05}, "weight_decay": 0.0, "l2": False},
]


# data parallel in the slow tier (the default suite's time): FSDP2's rows exercise the same count per rank
@pytest.mark.parametrize("layout", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_two_ranks_the_plan_counts_what_each_engine_holds(tmp_path: pathlib.Path, layout: str) -> None:
    """Both ranks on one machine: the plan's device bytes are the largest rank's, its host bytes the two together;
    each rank's own count is also what ``engine/budget.py`` gives for that rank's shapes."""
    from lightning_zenflow.engine.budget import device_bytes, host_bytes, resolve_format
    from lightning_zenflow.planner.shapes import engine_shapes, shapes_of

    dtype = torch.bfloat16
    codes = run_ranks(run, 2, layout, dtype, TWO_RANK_JOBS, str(tmp_path), timeout_s=240.0)
    assert codes == [0, 0]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    model = tiny_llama(dtype)
    shapes = shapes_of(model)
    for index, job in enumerate(TWO_RANK_JOBS):
        counted = [rank[index] for rank in ranks]
        row = planned(model, dtype, job["knobs"], job["weight_decay"], job["l2"], devices=2)[layout]
        assert max(c["device"] for c in counted) == row.engine_device, (job, counted)
        assert sum(c["host"] for c in counted) == row.engine_host, (job, counted)
        config = ZenFlowConfig(update_interval=2, **job["knobs"])
        host_format, interim = resolve_format(
            config, dtype, job["knobs"]["accumulate_on"], job["weight_decay"], not job["l2"]
        )
        for rank, count in enumerate(counted):
            matrices, vectors = engine_shapes(shapes, 2, layout, 2, rank)
            assert count["device"] == device_bytes(matrices, vectors, config, host_format, "cpu", interim), (job, rank)
            assert count["host"] == host_bytes(matrices, config, host_format), (job, rank)
        assert counted[0] != counted[1] or layout == "fsdp2"  # 301 rows: the ranks' blocks differ
