"""The largest model of the Qwen2.5 family (0.5 B to 72 B) that each way of training fits on a few machines, from
``lightning_zenflow.plan`` with its default rates: the table "The largest model per machine" of
docs/performance.md. Batch 4 x 1024 tokens per rank with activation checkpointing, bf16-true; the models' configs are
configs/models/Qwen2.5-*.json (no download). After the semicolon: what runs out first for the
next size up.

    python scripts/largest_models.py
"""

from __future__ import annotations

import pathlib
import sys

from lightning_zenflow import plan

MODELS = sorted(
    (pathlib.Path(__file__).resolve().parents[1] / "configs" / "models").glob("Qwen2.5-*.json"),
    key=lambda path: float(path.stem.split("-")[1].rstrip("B")),
)
MACHINES = [
    ("1 x H200 (141 GB), 128 GiB RAM", {"device_memory": "141GB", "host_memory": "128GiB"}, ("single",)),
    ("1 x H100 (80 GB), 256 GB RAM", {"device_memory": "80GB", "host_memory": "256GB"}, ("single",)),
    ("1 x 24 GB GPU, 128 GB RAM", {"device_memory": "24GB", "host_memory": "128GB"}, ("single",)),
    ("8 x 80 GB, 2 TB RAM", {"device_memory": "80GB", "host_memory": "2TB", "devices": 8}, ("ddp", "fsdp2")),
]
COLUMNS = {
    "plain AdamW": lambda row: row.setting.kind == "adamw",
    "synchronous offload": lambda row: row.name.startswith("sync-offload"),
    "ZenFlow defaults": lambda row: row.name in ("zenflow", "zenflow ddp", "zenflow fsdp2"),
    'ZenFlow `host_state="fp32"`': lambda row: _zenflow(row, "device", "fp32"),
    'ZenFlow `accumulate_on="host"`': lambda row: _zenflow(row, "host", "bf16"),
}
WORK = {"batch_size": 4, "block_size": 1024, "activation_checkpointing": True}


def _zenflow(row: object, mode: str, state: str) -> bool:
    config = row.config  # type: ignore[attr-defined]
    return (
        config is not None
        and row.accumulate_on == mode  # type: ignore[attr-defined]
        and config.host_state == state
        and config.topk_ratio == 0.1
        and config.update_interval != 1
    )


def main() -> int:
    plans = {}
    for label, machine, _ in MACHINES:
        for model in MODELS:
            plans[(label, model.stem)] = plan(str(model), **machine, **WORK)
    header = ["machine", *COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for label, _, layouts in MACHINES:
        for layout in layouts:
            cells = []
            for predicate in COLUMNS.values():
                candidates = []
                for model in MODELS:
                    result = plans[(label, model.stem)]
                    row = next(r for r in result.rows if r.setting.layout == layout and predicate(r))
                    candidates.append((model.stem.split("-")[1], result.parameters, row))
                fitting = [c for c in candidates if c[2].fits]
                largest = max(fitting, key=lambda c: c[1], default=None)
                bigger = [c for c in candidates if largest is None or c[1] > largest[1]]
                cell = "none" if largest is None else f"{largest[0]} ({largest[1] / 1e9:.1f} B)"
                if bigger:
                    cell += f"; {bigger[0][0]}: {bigger[0][2].limit}"
                cells.append(cell)
            name = label if layout == "single" else f"{label}, {'data parallel' if layout == 'ddp' else 'FSDP2'}"
            lines.append("| " + " | ".join([name, *cells]) + " |")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
