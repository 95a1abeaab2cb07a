"""The planner on the machines a 70 B fine-tune runs on: Llama-3.1-70B on one machine of 8 x 80 GB (FSDP2: each rank
loads its own rows; ZenFlow's defaults hold 82.4 GB per rank, a smaller ``topk_ratio`` fits with the host step hidden
at S <= 8, and the largest batch is named), Qwen2.5-72B on two such machines under HSDP, the peers' rows (FSDP2
``CPUOffloadPolicy``, DeepSpeed ZeRO-3 offload) with their documented bytes, and ``configs/llm_70b.yaml`` as the plan
writes it. One plan per machine for the module (about 7 s each)."""

from __future__ import annotations

import json
import pathlib
import shlex
import sys

import pytest

from lightning_zenflow import plan
from lightning_zenflow.cli import main
from lightning_zenflow.planner.costs import (
    EXPORT_TENSORS,
    FSDP_OFFLOAD_HOST_BYTES,
    LOADING_TENSORS,
    ZERO3_HOST_BYTES,
)
from lightning_zenflow.planner.machine import GB

pytest.importorskip("transformers", reason="model sources need `pip install '.[llm]'`")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
TARGET = {"device_memory": "80GB", "host_memory": "2TB", "devices": 8, "batch_size": 2}
TARGET["activation_checkpointing"] = True
"""``lightning-zenflow plan --model configs/models/Llama-3.1-70B.json --devices 8 --device-memory 80GB --host-memory
2TB --activation-checkpointing --batch-size 2``"""
EMBEDDING_BYTES = 128_256 * 8192 * 2
"""Llama-3.1-70B's largest tensor (the input embedding, and the output layer), bf16."""


@pytest.fixture(scope="module")
def llama_70b():
    return plan(str(MODELS / "Llama-3.1-70B.json"), **TARGET)


def test_zenflow_fits_70b_on_8_gpus_with_the_host_step_hidden_at_s_8_or_less(llama_70b) -> None:
    """The defaults hold 82.4 GB per rank on 80 GB; the plan finds the setting that fits (5 % of the columns on the
    device: half the selected columns' state) and recommends it, its window within 8 steps."""
    defaults = llama_70b.row("zenflow fsdp2")
    assert defaults.accumulate_on == "device"
    assert not defaults.fits
    assert sum(defaults.device.values()) / GB == pytest.approx(82.4, abs=0.1)
    assert defaults.device_peak == sum(defaults.device.values())  # the loading is not the peak any more
    row = llama_70b.recommended
    assert row is not None
    assert row.config is not None
    assert row.setting.layout == "fsdp2"
    assert row.fits
    assert row.interval <= 8
    assert row.interval_needed <= 8
    assert row.config.topk_ratio < 0.1
    assert row.accumulate_on == "device"
    assert row.device["optimizer"] < defaults.device["optimizer"]
    # ZenFlow against the peers and synchronous offload at the same rates
    for name in ("sync-offload fsdp2", "peer: fsdp2 CPUOffloadPolicy", "peer: deepspeed zero3 offload"):
        assert row.step_s < llama_70b.row(name).step_s / 5, name


def test_the_plan_names_the_largest_batch_and_the_batch_at_which_the_defaults_fit(llama_70b) -> None:
    assert llama_70b.largest_batch == 3
    assert llama_70b.smaller_batch is not None
    name, batch, margin = llama_70b.smaller_batch
    assert (name, batch) == ("zenflow fsdp2", 1)
    assert 0 <= margin < 2 * GB
    table = llama_70b.table()
    assert "largest batch that fits with it: --batch-size 3" in table
    assert "zenflow fsdp2 (the knobs as given) fits at --batch-size 1" in table
    # the default batch of 8 x 1024 tokens: the activations alone are 32 GB per rank
    eight = plan(str(MODELS / "Llama-3.1-70B.json"), **{**TARGET, "batch_size": 8})
    assert eight.activations / GB == pytest.approx(4 * llama_70b.activations / GB, rel=0.01)
    assert eight.row("zenflow fsdp2").device["activations"] / GB == pytest.approx(32.3, abs=0.1)


def test_under_fsdp2_each_rank_loads_its_share_and_the_export_is_a_tensor_at_a_time(llama_70b) -> None:
    """Built on meta, sharded, each rank reading its own rows: the device's loading peak is the shard and the largest
    tensor (19.7 GB, not the 141 GB of the whole model); the host holds a tensor per rank while loading, and rank 0's
    host a tensor or two while exporting. Data parallel still reads the whole model on every device."""
    for name in ("zenflow fsdp2", "adamw fsdp2", "sync-offload fsdp2", llama_70b.recommended.name):
        row = llama_70b.row(name)
        tensor = EMBEDDING_BYTES * (2 if name.startswith("adamw") else 1)  # plain AdamW loads in fp32
        assert row.device_loading == row.device["weights"] + LOADING_TENSORS * tensor, name
        assert row.host_loading == 8 * LOADING_TENSORS * tensor, name
        assert row.host_export == EXPORT_TENSORS * tensor, name
    assert llama_70b.row("zenflow fsdp2").device_loading / GB == pytest.approx(19.7, abs=0.1)
    assert llama_70b.row("zenflow ddp").host_export == 0  # rank 0 writes its own whole model


def test_the_peers_rows_hold_their_documented_bytes(llama_70b) -> None:
    parameters = llama_70b.parameters
    fsdp_offload = llama_70b.row("peer: fsdp2 CPUOffloadPolicy")
    assert fsdp_offload.host["engine"] == FSDP_OFFLOAD_HOST_BYTES * parameters == 16 * parameters
    assert fsdp_offload.device["weights"] == fsdp_offload.device["gradients"] == 0
    assert fsdp_offload.device["activations"] == llama_70b.row("zenflow fsdp2").device["activations"]
    zero3 = llama_70b.row("peer: deepspeed zero3 offload")
    assert zero3.host["engine"] == ZERO3_HOST_BYTES * parameters == 18 * parameters
    assert zero3.device["buffers"] == 2 * EMBEDDING_BYTES  # 4 B per parameter of the largest layer
    assert zero3.device["activations"] == llama_70b.activations
    for row in (fsdp_offload, zero3):
        assert row.fits
        # the host step of every parameter at every step: 28-30 B each at the machine's 50 GB/s
        assert row.times["worker"] == pytest.approx(parameters * (28 if row is fsdp_offload else 30) / 50e9, rel=0.01)
        assert row is not llama_70b.recommended


def test_a_rank_adds_at_its_share_of_the_machines_host_add_rate(llama_70b) -> None:
    """Host mode's add on 8 ranks: together the machine's 20 GB/s (10 B per bf16 gradient element), so a rank's add
    of its (1 - rho) share takes as long as the machine's add of all the unselected columns."""
    row = llama_70b.row("zenflow accumulate_on=host host_state=bf16 fsdp2")
    whole = 0.9 * llama_70b.parameters * 10 / 20e9
    assert row.times["host_add"] == pytest.approx(whole, rel=0.02)
    assert row.step_s > 5 * llama_70b.recommended.step_s


def test_qwen_72b_fits_two_machines_of_8_gpus_under_hsdp(capsys: pytest.CaptureFixture) -> None:
    args = ["--model", str(MODELS / "Qwen2.5-72B.json"), "--devices", "8", "--nodes", "2", "--device-memory", "80GB"]
    args += ["--host-memory", "2TB", "--activation-checkpointing", "--batch-size", "2", "--json"]
    assert main(["plan", *args]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in result["rows"]}
    assert "zenflow hsdp" in rows
    assert "peer: hsdp CPUOffloadPolicy" in rows
    recommended = rows[result["recommended"]["name"]]
    assert recommended["kind"] == "zenflow"
    assert recommended["layout"] == "fsdp2"
    assert recommended["name"].endswith(" hsdp")
    assert recommended["fits"]
    assert recommended["update_interval"] <= 8
    assert "--trainer.num_nodes=2" in result["recommended"]["command"]
    assert "--trainer.strategy.shard_size=auto" in result["recommended"]["command"]
    # sharded within a machine: each machine holds the whole model's host state, each GPU 1/8 of the weights
    parameters = result["parameters"]
    assert recommended["engine_host_bytes"] / parameters == pytest.approx(6, rel=0.01)
    assert recommended["device_parts"]["weights"] == pytest.approx(2 * parameters / 8, rel=0.01)
    # the gradients' all-reduce across the machines: 2 (M - 1)/M of the bf16 gradients at 25 GB/s per machine
    assert result["machine"]["rates"]["internode_gbps"] == 25.0
    assert recommended["times_s"]["internode"] == pytest.approx(2 * parameters / 25e9, rel=0.01)
    assert recommended["step_s"] >= recommended["times_s"]["internode"]


def test_configs_llm_70b_yaml_is_what_plan_writes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    """The shipped config is the output of the command in its header (run here with the output elsewhere)."""
    shipped = (ROOT / "configs" / "llm_70b.yaml").read_text()
    command = next(line[4:] for line in shipped.splitlines() if line.startswith("#   lightning-zenflow plan "))
    args = shlex.split(command)[2:]
    assert args[args.index("--write-config") + 1] == "configs/llm_70b.yaml"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "models").symlink_to(MODELS)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        assert main(["plan", *args]) == 0
    capsys.readouterr()
    assert (tmp_path / "configs" / "llm_70b.yaml").read_text() == shipped


def test_configs_llm_70b_yaml_parses_into_zenflow_fsdp(
    capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the CLI as a user runs it (the model is not read: ``--print_config`` stops before)."""
    monkeypatch.setattr(sys, "argv", ["lightning-zenflow"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / "llm_70b.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "class_path: lightning_zenflow.ZenFlowFSDPStrategy" in printed
    assert "topk_ratio: 0.05" in printed
    assert "devices: 8" in printed
    assert "model_path: meta-llama/Llama-3.1-70B" in printed
    assert "batch_size: 2" in printed
