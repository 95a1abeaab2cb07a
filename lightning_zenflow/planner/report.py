"""A plan as people read it (one table, the recommendation, the command), as JSON, and as the YAML that runs the
recommended setting with ``configs/llm.yaml``'s module and data (``--write-config``)."""

from __future__ import annotations

import shlex
from typing import Any

from lightning_zenflow.planner.costs import Row
from lightning_zenflow.planner.machine import GB

STRATEGY_FSDP = "lightning_zenflow.ZenFlowFSDPStrategy"
MODULE_DTYPE = {"bf16-true": "bfloat16"}
"""``--model.dtype``: bf16 weights load in bf16 (half the host memory on the way); every other precision in fp32."""


def _gb(size: float) -> str:
    return f"{size / GB:.1f}"


def _margin(row: Row) -> str:
    side = row.limit
    margin = row.device_margin if side == "device" else row.host_margin
    sign = "+" if margin >= 0 else "-"
    return f"{sign}{abs(margin) / GB:.1f} {side}"


def row_knobs(row: Row) -> dict[str, Any]:
    """The knobs that run ``row``: ZenFlow's as resolved (the accumulation mode, the window), or plain AdamW's."""
    if row.setting.kind == "fsdp_offload":
        return {"strategy": "fsdp2", "offload_policy": "CPUOffloadPolicy", "precision": "bf16-mixed"}
    if row.setting.kind == "zero3_offload":
        return {"strategy": "deepspeed_stage_3_offload", "precision": "bf16-mixed"}
    if row.config is None:
        return {"strategy": "fsdp2" if row.setting.layout == "fsdp2" else "auto", "precision": "bf16-mixed"}
    knobs = {
        "topk_ratio": row.config.topk_ratio,
        "update_interval": row.interval,
        "accumulate_on": row.accumulate_on,
        "host_state": row.config.host_state,
    }
    if not row.config.overlap_step:
        knobs["overlap_step"] = False
    return knobs


def render_table(plan: Any) -> str:
    work, machine = plan.workload, plan.machine
    active = ""
    if plan.active_parameters is not None:
        active = f" ({plan.active_parameters / 1e9:.3f} B active: {plan.routing})"
    lines = [
        f"model: {plan.model}, {plan.parameters / 1e9:.3f} B trainable parameters{active}; {work.precision}, "
        f"{work.batch_size} x {work.block_size} tokens per rank and step, activation checkpointing "
        f"{'on' if work.activation_checkpointing else 'off'}",
        f"machine: {machine.describe()}",
        "activations per rank (estimate): "
        + (f"{_gb(plan.activations)} GB" if plan.activations is not None else "not estimated (no example input)"),
        "",
    ]
    header = [
        "setting",
        "weights",
        "grads",
        "optim",
        "buffers",
        "activ",
        "device",
        "h.engine",
        "h.pinned",
        "host",
        "fits",
        "margin GB",
        "S need",
        "S",
        "step s",
        "x sync",
    ]
    sync = {r.setting.layout: r.step_s for r in plan.rows if r.name.startswith("sync-offload")}
    table = [header]
    for row in plan.rows:
        zenflow = row.config is not None
        hidden = "-" if not zenflow or not row.config.overlap_step else (str(row.interval_needed or ">256"))
        against = sync.get(row.setting.layout)
        table.append(
            [
                row.name + (" *" if row is plan.recommended else ""),
                _gb(row.device["weights"]),
                _gb(row.device["gradients"]),
                _gb(row.device["optimizer"]),
                _gb(row.device["buffers"]),
                _gb(row.device["activations"]),
                _gb(row.device_peak),
                _gb(row.host["engine"]),
                _gb(row.host["staging"]),
                _gb(row.host_peak),
                "yes" if row.fits else "no",
                _margin(row),
                hidden,
                str(row.interval) if zenflow else "-",
                f"{row.step_s:.3g}",
                f"{row.step_s / against:.2f}" if against else "-",
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for index, cells in enumerate(table):
        text = [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        lines.append("  ".join(text).rstrip())
        if index == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [
        "",
        "GB per rank on the device (peak: the sum, or the loading's or a selection's peak) and per machine on the "
        "host (engine: its shared state, a peer's offloaded state; pinned: host mode's staging; host: the peak with "
        "the system, the processes, loading, checkpoints and export). Under FSDP2 each rank loads its own rows (its "
        "share and the largest tensor), checkpoints are sharded and the export is gathered a tensor at a time. S "
        "need: the shortest window that hides the host step; step s: the expected step time; x sync: against "
        "synchronous offload. peer: FSDP2 CPUOffloadPolicy (16 B per parameter on the host) and DeepSpeed ZeRO-3 "
        "offloading optimizer and parameters (18 B), their host step every step. * recommended.",
    ]
    if plan.active_parameters is not None:
        lines[-1] += (
            " A mixture of experts: forward and backward count the parameters a token runs through; weights, "
            "gradients, optimizer state and every optimizer step count all experts. No expert parallelism: data "
            "parallel replicates every expert, FSDP2 shards each expert's rows like any parameter."
        )
    lines += recommendation_lines(plan)
    return "\n".join(lines)


def recommendation_lines(plan: Any) -> list[str]:
    row = plan.recommended
    if row is None:
        closest = max(plan.rows, key=lambda r: min(r.device_margin, r.host_margin))
        ideas = [] if plan.workload.activation_checkpointing else ["--activation-checkpointing"]
        ideas += ["a smaller --batch-size", "a smaller --topk-ratio", "more devices (FSDP2 divides the device's share)"]
        return [
            "",
            f"nothing fits. Closest: {closest.name}, short by {_margin(closest).lstrip('-')}. Try {', '.join(ideas)}.",
            *batch_lines(plan),
        ]
    knobs = ", ".join(f"{k}={v}" for k, v in row_knobs(row).items())
    lines = [
        "",
        f"recommended: {row.name} ({knobs}): {_gb(row.device_peak)} GB per device, {_gb(row.host_peak)} GB of host "
        f"memory, about {row.step_s:.3g} s a step.",
    ]
    lines += batch_lines(plan)
    return lines + ["run it with configs/llm.yaml's module and data:", "  " + command(plan, row)]


def batch_lines(plan: Any) -> list[str]:
    """The largest batch the recommended row fits, and the batch at which the knobs' own row would fit."""
    lines = []
    tokens = plan.workload.block_size
    if plan.largest_batch is not None:
        lines.append(
            f"largest batch that fits with it: --batch-size {plan.largest_batch} ({plan.largest_batch} x {tokens} "
            "tokens per rank; more tokens per step: --trainer.accumulate_grad_batches)."
        )
    if plan.smaller_batch is not None:
        name, batch, margin = plan.smaller_batch
        lines.append(
            f"{name} (the knobs as given) fits at --batch-size {batch}, with {margin / GB:.1f} GB of the device to "
            "spare."
        )
    return lines


def command_args(plan: Any, row: Row) -> list[str]:
    """The options on top of ``--config configs/llm.yaml`` that run ``row``."""
    work, machine = plan.workload, plan.machine
    path = plan.model_path or plan.model
    args = [f"--model.model_path={path}", f"--data.tokenizer_path={path}"]
    precision = work.precision if row.config is not None else "bf16-mixed"
    args += [f"--trainer.precision={precision}", f"--model.dtype={MODULE_DTYPE.get(precision, 'float32')}"]
    if machine.device_type == "cuda":
        args.append("--trainer.accelerator=gpu")
    if machine.devices > 1 or machine.nodes > 1:
        args.append(f"--trainer.devices={machine.devices}")
    if machine.nodes > 1:
        args.append(f"--trainer.num_nodes={machine.nodes}")
    args += [f"--data.batch_size={work.batch_size}", f"--data.block_size={work.block_size}"]
    if work.activation_checkpointing:
        args.append("--model.activation_checkpointing=true")
    if row.config is None:
        return [*args, "--trainer.strategy=ddp" if machine.ranks > 1 else "--trainer.strategy=auto"]
    if row.setting.layout == "fsdp2":
        args.append(f"--trainer.strategy={STRATEGY_FSDP}")
        if machine.nodes > 1:  # HSDP: one machine per shard group, the machines are replicas
            args.append("--trainer.strategy.shard_size=auto")
    for name, value in row_knobs(row).items():
        args.append(f"--trainer.strategy.{name}={str(value).lower() if isinstance(value, bool) else value}")
    return args


def command(plan: Any, row: Row) -> str:
    options = " ".join(shlex.quote(a) for a in command_args(plan, row))
    return f"lightning-zenflow fit --config configs/llm.yaml {options}"


def plan_json(plan: Any) -> dict[str, Any]:
    work, machine = plan.workload, plan.machine
    rows = []
    for row in plan.rows:
        rows.append(
            {
                "name": row.name,
                "kind": row.setting.kind,
                "layout": row.setting.layout,
                "knobs": row_knobs(row),
                "device_bytes_per_rank": row.device_peak,
                "device_parts": dict(row.device),
                "device_loading_bytes": row.device_loading,
                "host_bytes_per_machine": row.host_peak,
                "host_parts": dict(row.host),
                "host_loading_bytes": row.host_loading,
                "host_export_bytes": row.host_export,
                "host_checkpoint_bytes": row.host_checkpoint,
                "engine_device_bytes": row.engine_device,
                "engine_host_bytes": row.engine_host,
                "fits": row.fits,
                "device_margin_bytes": row.device_margin,
                "host_margin_bytes": row.host_margin,
                "update_interval": row.interval,
                "update_interval_needed": row.interval_needed,
                "step_s": row.step_s,
                "times_s": dict(row.times),
            }
        )
    recommended = None
    if plan.recommended is not None:
        recommended = {
            "name": plan.recommended.name,
            "knobs": row_knobs(plan.recommended),
            "command": command(plan, plan.recommended),
        }
    return {
        "model": plan.model,
        "parameters": plan.parameters,
        "active_parameters": plan.active_parameters,
        "routing": plan.routing or None,
        "machine": {
            "device_type": machine.device_type,
            "device_memory": machine.device_memory,
            "host_memory": machine.host_memory,
            "devices": machine.devices,
            "nodes": machine.nodes,
            "rates": {
                k: getattr(machine, k)
                for k in (
                    "d2h_gbps",
                    "h2d_gbps",
                    "device_gbps",
                    "device_tflops",
                    "host_step_gbps",
                    "host_add_gbps",
                    "copy_gbps",
                    "network_gbps",
                    "internode_gbps",
                )
            },
            "measured": dict(machine.measured),
        },
        "workload": {
            "precision": work.precision,
            "batch_size": work.batch_size,
            "block_size": work.block_size,
            "activation_checkpointing": work.activation_checkpointing,
        },
        "activation_bytes_per_rank": plan.activations,
        "rows": rows,
        "recommended": recommended,
        "largest_batch": plan.largest_batch,
        "smaller_batch": None
        if plan.smaller_batch is None
        else dict(zip(("name", "batch_size", "device_margin_bytes"), plan.smaller_batch)),
    }
