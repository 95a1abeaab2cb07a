"""``--write-config PATH``: the LightningCLI YAML that runs a plan's recommended row with ``configs/llm.yaml``'s
module and data (``lightning_zenflow.llm``), its header saying which command wrote it and what the plan expects."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from lightning_zenflow.planner.costs import Row
from lightning_zenflow.planner.machine import GB
from lightning_zenflow.planner.report import MODULE_DTYPE, row_knobs
from lightning_zenflow.planner.sizes import PlanError

LAUNCH_SECTION = "Llama-3.1-70B on one machine of 8 GPUs, and Qwen2.5-72B on two"
"""The section of docs/distributed.md with the launch commands on one machine and on several."""
STRATEGY_CLASSES = {
    "single": "lightning_zenflow.ZenFlowStrategy",
    "ddp": "lightning_zenflow.ZenFlowStrategy",
    "fsdp2": "lightning_zenflow.ZenFlowFSDPStrategy",
}


def _gb(size: float) -> str:
    return f"{size / GB:.1f} GB"


def _header(plan: Any, row: Row, command: str, path: Path) -> list[str]:
    work, machine = plan.workload, plan.machine
    device = row.device
    layout = row.setting.layout
    sync = next((r for r in plan.rows if r.name.startswith("sync-offload") and r.setting.layout == layout), None)
    gpus = f"{machine.devices} GPU{'s' if machine.devices > 1 else ''}"
    if machine.nodes > 1:
        gpus = f"{machine.nodes} machines of {gpus}"
    active = ""
    if plan.active_parameters is not None:  # a mixture of experts: the step's compute is its active parameters'
        active = f", {plan.active_parameters / 1e9:.2f} B active: {plan.routing}"
    lines = [
        f"configs/llm.yaml's fine-tune for {plan.model_path or plan.model} ({plan.parameters / 1e9:.2f} B parameters"
        f"{active}) "
        f"on {gpus} of {_gb(machine.device_memory)} with {_gb(machine.host_memory)} of RAM per machine: the "
        f"setting `lightning-zenflow plan` recommends ({_setting_name(row)}), written by",
        "",
        f"  {command}",
        "",
        "The plan (estimates from the engine's byte counts and the cost model of docs/performance.md; not measured):",
        f"- device, per GPU: {_gb(row.device_peak)} at the peak (weights {_gb(device['weights'])}, gradients "
        f"{_gb(device['gradients'])}, optimizer state {_gb(device['optimizer'])}, the engine's buffers "
        f"{_gb(device['buffers'])}, activations {_gb(device['activations'])}; a selection holds "
        f"{_gb(row.device_selection)} for a moment); {_gb(row.device_margin)} to spare",
        f"- host: {_gb(row.host_peak)} per machine at the peak (the engine's state {_gb(row.host['engine'])}); "
        f"{_gb(row.host_margin)} to spare",
    ]
    if row.config is not None:
        hidden = f"hidden from S = {row.interval_needed}" if row.interval_needed else "never hidden"
        lines.append(
            f"- step: about {row.step_s:.3g} s at S = {row.interval} (the host step is {hidden})"
            + (f"; synchronous offload: about {sync.step_s:.3g} s" if sync is not None else "")
        )
    if plan.largest_batch is not None:
        lines.append(
            f"- batch: {work.batch_size} x {work.block_size} tokens per rank; the largest that fits is "
            f"{plan.largest_batch} (data.batch_size)"
        )
    if layout == "fsdp2":
        lines.append(
            f"- FSDP2{' (HSDP: sharded within a machine, replicated across machines)' if machine.nodes > 1 else ''}: "
            f"each rank reads its own rows of the weights ({_gb(row.device_loading)} per GPU at the peak), "
            "checkpoints are sharded, the export is gathered a tensor at a time"
        )
    lines += [
        "",
        "Train on your data (text files, or a .jsonl of instructions; docs/llm.md):",
        "",
        f'  python -m pip install -e ".[llm]" && lightning-zenflow fit --config {path.as_posix()} '
        "--data.data_path my_data.jsonl",
        "",
        "model_path is any causal LM transformers loads: a local Hugging Face folder, a .gguf file, or a Hub name "
        "where the machine reaches the Hub. "
        + (
            "A checkpoint every 500 steps."
            if work.checkpoints
            else "No checkpoints are saved: each would merge the optimizer state in fp32 in host memory (12 B per "
            f"parameter{', each rank its share' if layout == 'fsdp2' else ' on rank 0'}); plan with --checkpoints "
            "before adding a ModelCheckpoint."
        ),
    ]
    if machine.nodes > 1 or machine.devices > 1:
        lines += ["", f"Launch: docs/distributed.md, {LAUNCH_SECTION!r}."]
    wrapped = []
    for line in lines:
        if line.startswith("- "):
            wrapped += textwrap.wrap(line, 116, initial_indent="  ", subsequent_indent="    ")
        elif line.startswith("  ") or not line:
            wrapped.append(line)  # a command: one line, to copy
        else:
            wrapped += textwrap.wrap(line, 116)
    return [f"# {line}".rstrip() for line in wrapped]


def _setting_name(row: Row) -> str:
    return "ZenFlow's defaults" if row.name == "zenflow" else row.name


def config_yaml(plan: Any, command: str, path: Path) -> str:
    """The YAML text for ``plan``'s recommended row."""
    row = plan.recommended
    if row is None:
        raise PlanError("--write-config: nothing fits this machine, so there is no setting to write; see the table.")
    if row.config is None:
        raise PlanError(
            "--write-config: plain AdamW fits without offloading, so ZenFlow has nothing to do here; run "
            "configs/llm.yaml with --trainer.strategy auto instead."
        )
    work, machine = plan.workload, plan.machine
    model_path = plan.model_path or plan.model
    strategy_args = dict(row_knobs(row))
    if row.setting.layout == "fsdp2" and machine.nodes > 1:
        strategy_args["shard_size"] = "auto"  # HSDP: one machine per shard group, the machines are replicas
    knobs = "\n".join(f"      {name}: {_yaml_value(value)}" for name, value in strategy_args.items())
    root = f"runs/{path.stem}"
    callbacks = [
        "    - class_path: lightning_zenflow.ZenFlowTelemetry",
        "      init_args:",
        "        loss_key: val_loss",
    ]
    if work.checkpoints:
        callbacks += [
            "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint",
            "      init_args:",
            "        every_n_train_steps: 500",
            "        save_top_k: -1",
        ]
    sample = 'sample_prompt: "The json module"'
    if row.setting.layout == "fsdp2":  # a sample generates from the whole model, gathered on rank 0's host
        sample = "sample_prompt: null  # under FSDP2 a sample would gather the whole model on rank 0's host"
    body = f"""seed_everything: 0
trainer:
  accelerator: gpu
  devices: {machine.devices}
  num_nodes: {machine.nodes}
  strategy:
    class_path: {STRATEGY_CLASSES[row.setting.layout]}
    init_args:
{knobs}
  precision: {work.precision}
  max_steps: 1000
  max_epochs: 1
  val_check_interval: 200
  limit_val_batches: 50
  num_sanity_val_steps: 0
  gradient_clip_val: 1.0
  log_every_n_steps: 10
  default_root_dir: {root}
  callbacks:
{chr(10).join(callbacks)}
model:
  class_path: lightning_zenflow.llm.CausalLMFineTune
  init_args:
    model_path: {model_path}
    dtype: {MODULE_DTYPE.get(work.precision, "float32")}
    activation_checkpointing: {str(work.activation_checkpointing).lower()}
    lr: 1.0e-5
    weight_decay: 0.0
    warmup_steps: 20
    export_dir: {root}/export
    {sample}
    sample_tokens: 32
data:
  class_path: lightning_zenflow.llm.CausalLMDataModule
  init_args:
    data_path: null  # null: the standard library's documentation prose; or your text, or a .jsonl of instructions
    tokenizer_path: {model_path}  # the model's own
    block_size: {work.block_size}
    batch_size: {work.batch_size}
    val_fraction: 0.05
"""
    return "\n".join(_header(plan, row, command, path)) + "\n" + body


def _yaml_value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def write_config(plan: Any, command: str, path: str) -> Path:
    target = Path(path)
    text = config_yaml(plan, command, target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    except OSError as error:
        raise PlanError(f"--write-config {path}: cannot write it ({error.strerror}); name a writable file.") from error
    return target
