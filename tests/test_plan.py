"""``lightning-zenflow plan`` and ``lightning_zenflow.plan``: model sources built on the meta device (no weights read,
tied embeddings once), the rows and the recommendation, the command and the YAML it writes (``configs/llm_gpu.yaml``
is its output), bad input as one line with exit status 2, and a 70 B config planned in seconds. The engine's bytes in
the rows are checked against running engines in ``tests/test_plan_budget.py``."""

from __future__ import annotations

import json
import pathlib
import shlex
import sys
import time

import huggingface_hub.constants
import pytest
import torch

from lightning_zenflow import plan
from lightning_zenflow.cli import main
from lightning_zenflow.planner import Machine, PlanError, parse_size
from lightning_zenflow.planner.report import command_args

transformers = pytest.importorskip("transformers", reason="model sources need `pip install '.[llm]'`")

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "models"
H200 = {"device_memory": "141GB", "host_memory": "128GiB"}


def run_cli(args: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main(["plan", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize(
    ("text", "size"),
    [("141GB", 141 * 10**9), ("128GiB", 128 * 2**30), ("80 gb", 80 * 10**9), ("1.5TB", 1.5e12), ("4096", 4096)],
)
def test_sizes_are_read_as_people_write_them(text: str, size: float) -> None:
    assert parse_size(text, "--host-memory") == int(size)


@pytest.mark.parametrize("text", ["141XB", "lots", "-3GB", "0GB"])
def test_a_size_it_cannot_read_names_the_option_and_the_form(text: str) -> None:
    with pytest.raises(PlanError, match=r"--device-memory .*(141GB or 128GiB|unknown unit|larger than zero)"):
        parse_size(text, "--device-memory")


@pytest.mark.parametrize(
    ("name", "parameters"),
    [
        ("SmolLM2-135M", 134_515_008),
        ("Qwen2.5-0.5B", 494_032_768),
        ("Qwen2.5-7B", 7_615_616_512),
        ("Qwen2.5-14B", 14_770_033_664),
        ("Qwen2.5-72B", 72_706_203_648),
        ("Llama-3.1-70B", 70_553_706_496),
    ],
)
def test_a_config_is_built_on_the_meta_device_with_tied_embeddings_once(name: str, parameters: int) -> None:
    """The published parameter counts (SmolLM2 and the small Qwens tie their embeddings: counted once)."""
    from lightning_zenflow.planner.shapes import shapes_from_source

    shapes = shapes_from_source(str(MODELS / f"{name}.json"), torch.bfloat16)
    assert shapes.parameters == parameters
    assert all(p.is_meta for p in shapes.model.parameters())
    assert shapes.model_path == json.loads((MODELS / f"{name}.json").read_text())["_name_or_path"]


def test_a_folder_and_a_gguf_file_are_read_without_their_weights(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("gguf", reason="GGUF needs `pip install '.[llm]'`")
    from llm_helpers import save_tiny_llama
    from test_llm_extras import _write_gguf

    folder = save_tiny_llama(tmp_path / "model")
    expected = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_pretrained(folder).parameters())
    gguf = _write_gguf(folder, tmp_path / "tiny.gguf")
    for source in (folder, folder / "config.json", gguf):
        result = plan(str(source), batch_size=2, block_size=16, **H200)
        assert result.parameters == expected, source
    assert plan(str(folder), **H200).model_path == str(folder)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "no/such/folder/here"], "--model 'no/such/folder/here' does not exist"),
        (["--model", "README.md"], "is a file that is neither .json nor .gguf"),
        (["--model", "nobody-here/no-such-model"], "transformers cannot read its config"),
        (["--device-memory", "141XB"], "--device-memory '141XB' has an unknown unit"),
        (["--host-memory", "lots"], "--host-memory 'lots' is not a size"),
        (["--topk-ratio", "2"], "--topk-ratio: topk_ratio=2.0 is outside [0, 1]"),
        (["--update-interval", "0"], "--update-interval: update_interval=0 must be >= 1"),
        (["--update-interval", "often"], "argument --update-interval: 'often' is not a whole number"),
        (["--devices", "0"], "--devices 0 must be a whole number >= 1"),
        (["--batch-size", "0"], "--batch-size 0 must be a whole number >= 1"),
        (["--precision", "fp8"], "argument --precision: invalid choice"),
        (["--write-config", "/proc/no/such.yaml"], "--write-config /proc/no/such.yaml: cannot write it"),
    ],
)
def test_bad_input_is_one_line_naming_the_option_and_exit_status_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a Hub name is looked up in the cache only: the variable for a new process, the constant for this one, where
    # huggingface_hub may have read the variable already (else five retries over the network, 23 s)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    model = [] if "--model" in args else ["--model", str(MODELS / "Qwen2.5-0.5B.json")]
    code, out, err = run_cli([*model, "--device-memory", "24GB", "--host-memory", "64GB", *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: "), err
    assert message in lines[0], err
    assert lines[1].startswith("tip: ")
    assert len(lines) == 2
    assert out == ""


def test_the_json_has_the_rows_and_the_recommendation(capsys: pytest.CaptureFixture) -> None:
    args = ["--model", str(MODELS / "Qwen2.5-7B.json"), "--device-memory", "80GB", "--host-memory", "256GB"]
    code, out, _ = run_cli([*args, "--activation-checkpointing", "--json"], capsys)
    assert code == 0
    result = json.loads(out)
    assert result["parameters"] == 7_615_616_512
    names = [row["name"] for row in result["rows"]]
    assert names[:3] == ["adamw", "sync-offload", "zenflow"]
    for row in result["rows"]:
        assert {"name", "device_bytes_per_rank", "host_bytes_per_machine", "fits"} <= row.keys()
    assert result["recommended"]["name"] in names
    assert result["recommended"]["knobs"]["accumulate_on"] in ("device", "host")
    by_name = {row["name"]: row for row in result["rows"]}
    assert not by_name["adamw"]["fits"]  # 16 B per parameter: 122 GB
    # the defaults' row holds 6 B per parameter on the host in device mode, 12 in host mode
    zenflow = by_name["zenflow"]
    per_parameter = {"device": 6, "host": 12}[zenflow["knobs"]["accumulate_on"]]
    assert zenflow["engine_host_bytes"] / result["parameters"] == pytest.approx(per_parameter, rel=0.01)


def test_several_devices_add_data_parallel_and_fsdp2_rows_and_a_70b_config_plans_in_seconds() -> None:
    """Llama-3.1-70B on 8 x 80 GB: every row twice (data parallel, FSDP2) and the peers' rows; FSDP2 divides the
    device's terms, its loading holds the rank's share and the largest tensor (built on meta, sharded, each rank
    reading its rows), and 8 x 1024 tokens without activation checkpointing (269 GB of activations) fit nowhere."""
    started = time.perf_counter()
    result = plan(str(MODELS / "Llama-3.1-70B.json"), device_memory="80GB", host_memory="2TB", devices=8)
    assert time.perf_counter() - started < 10.0
    layouts = {row.setting.layout for row in result.rows}
    assert layouts == {"ddp", "fsdp2"}
    ddp, fsdp = result.row("zenflow ddp"), result.row("zenflow fsdp2")
    assert fsdp.device["weights"] == pytest.approx(ddp.device["weights"] / 8, rel=0.01)
    embedding = 128_256 * 8192 * 2  # the largest tensor, bf16
    assert fsdp.device_loading == fsdp.device["weights"] + embedding
    assert fsdp.device_loading < fsdp.device_peak
    assert not fsdp.fits
    assert result.activations > 200e9
    # the host state is split either way: the same setting holds the same host bytes per machine
    same_ddp = result.row("zenflow accumulate_on=device host_state=fp32 ddp")
    same_fsdp = result.row("zenflow accumulate_on=device host_state=fp32 fsdp2")
    assert same_fsdp.engine_host == pytest.approx(same_ddp.engine_host, rel=0.01)
    # "auto" takes the device under FSDP2 (its share of the weights leaves room) and the host under data parallel
    assert (ddp.accumulate_on, fsdp.accumulate_on) == ("host", "device")


def test_the_defaults_fit_qwen_14b_on_one_h200_and_a_smaller_topk_fits_a_smaller_gpu() -> None:
    """Qwen2.5-14B with activation checkpointing: on one H200 with 128 GiB the defaults fit in device mode (a
    selection's transient is one migration chunk, not the model); on 125 GB the defaults do not (device accumulation
    runs out of device memory, host accumulation out of host memory: 12 B per parameter) and 5 % of the columns on
    the device fit."""
    result = plan(str(MODELS / "Qwen2.5-14B.json"), activation_checkpointing=True, **H200)
    defaults = result.row("zenflow")
    assert defaults.accumulate_on == "device"
    assert defaults.fits
    assert result.recommended.name == "zenflow"
    assert defaults.device_selection < defaults.device_peak  # the selection's moment is not the peak
    on_125 = {**H200, "device_memory": "125GB"}
    smaller = plan(str(MODELS / "Qwen2.5-14B.json"), activation_checkpointing=True, **on_125)
    device = smaller.row("zenflow accumulate_on=device host_state=bf16")
    assert not device.fits
    assert smaller.row("zenflow").accumulate_on == "host"
    assert not smaller.row("zenflow").fits
    assert smaller.recommended is not None
    assert smaller.recommended.name == "zenflow topk_ratio=0.05"
    assert smaller.recommended.accumulate_on == "device"


def test_the_step_time_needs_a_longer_window_when_the_host_is_slower() -> None:
    windows = []
    for gbps in (200.0, 50.0, 10.0):
        machine = Machine("cuda", 80 * 10**9, 256 * 10**9, host_step_gbps=gbps)
        row = plan(str(MODELS / "Qwen2.5-7B.json"), machine=machine, accumulate_on="device").row("zenflow")
        windows.append(row.interval_needed)
        assert row.step_s < plan(str(MODELS / "Qwen2.5-7B.json"), machine=machine).row("sync-offload").step_s
    assert windows == sorted(windows)
    assert windows[0] < windows[-1]


def test_activation_checkpointing_keeps_less_and_the_batch_scales_it() -> None:
    source = str(MODELS / "Qwen2.5-0.5B.json")
    one = plan(source, batch_size=1, **H200).activations
    two = plan(source, batch_size=2, **H200).activations
    kept = plan(source, batch_size=2, activation_checkpointing=True, **H200).activations
    assert two == pytest.approx(2 * one, rel=0.01)
    assert kept < 0.6 * two  # the logits stay: a third of what a 0.5 B model keeps


def test_the_python_twin_takes_any_module_and_a_lightning_module(tmp_path: pathlib.Path) -> None:
    from llm_helpers import save_tiny_llama

    from lightning_zenflow.demo import GPT, GPTConfig
    from lightning_zenflow.llm import CausalLMFineTune

    with torch.device("meta"):
        gpt = GPT(GPTConfig())
    tokens = torch.zeros(4, 128, dtype=torch.long, device="meta")
    result = plan(gpt, example_input=(tokens, tokens), precision="32-true", **H200)
    assert result.parameters == 875_264
    assert result.activations > 0
    assert plan(gpt, **H200).activations is None
    module = CausalLMFineTune(str(save_tiny_llama(tmp_path / "model")))
    assert plan(module, **H200).parameters == sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    ("options", "strategy"),
    [
        ({}, "class_path: lightning_zenflow.ZenFlowStrategy"),
        ({"devices": 2, "layout": "fsdp2"}, "ZenFlowFSDPStrategy"),
        ({"devices": 2, "nodes": 2, "layout": "hsdp"}, "shard_size: auto"),
    ],
    ids=["one-device", "fsdp2", "hsdp"],
)
def test_the_recommended_command_runs_through_the_cli(
    options: dict, strategy: str, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The options printed for a row, on top of configs/llm.yaml, parse (``--print_config``) into that setting."""
    layout = options.pop("layout", None)
    result = plan(str(MODELS / "Qwen2.5-0.5B.json"), device_memory="24GB", host_memory="64GB", **options)
    row = result.recommended if layout is None else result.row(f"zenflow {layout}")
    monkeypatch.setattr(sys, "argv", ["lightning-zenflow"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(ROOT / "configs" / "llm.yaml"), *command_args(result, row), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert strategy in printed
    assert f"update_interval: {row.interval}" in printed
    assert f"accumulate_on: {row.accumulate_on}" in printed
    assert "model_path: Qwen/Qwen2.5-0.5B" in printed


def test_configs_llm_gpu_yaml_is_what_plan_writes(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture) -> None:
    """The shipped config is the output of the command in its header (run here with the output elsewhere)."""
    shipped = (ROOT / "configs" / "llm_gpu.yaml").read_text()
    command = next(line[4:] for line in shipped.splitlines() if line.startswith("#   lightning-zenflow plan "))
    args = shlex.split(command)[2:]
    assert args[args.index("--write-config") + 1] == "configs/llm_gpu.yaml"
    monkeypatch_dir = tmp_path / "configs"
    monkeypatch_dir.mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        (tmp_path / "configs" / "models").symlink_to(MODELS)
        code, out, _ = run_cli(args, capsys)
    assert code == 0, out
    assert (tmp_path / "configs" / "llm_gpu.yaml").read_text() == shipped
