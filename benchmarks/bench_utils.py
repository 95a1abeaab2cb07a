"""Shared helpers of the benchmark scripts: machine description, core pinning, statistics, tables, JSON, plots.

Not a benchmark itself. The scripts import it as ``bench_utils`` (Python puts the script's folder on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch


def cpu_model_name() -> str:
    """The CPU model from ``/proc/cpuinfo`` (Linux), else what ``platform`` knows."""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown"


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def machine_info(device: torch.device) -> dict[str, Any]:
    """Where and when a benchmark ran: CPU model, cores, memory, versions, accelerator, date, load average."""
    import lightning_zenflow

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model_name(),
        "cpu_count": os.cpu_count(),
        "available_cores": len(available_cores()),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "lightning_zenflow": lightning_zenflow.__version__,
        "torch_threads_default": torch.get_num_threads(),
        "device": str(device),
        "device_name": cpu_model_name() if device.type == "cpu" else torch.cuda.get_device_name(device),
        "load_average_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info["device_memory_gib"] = round(properties.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def _memory_gib() -> float | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    return None


def describe_machine(info: dict[str, Any]) -> str:
    """One line for the printed header."""
    load = info.get("load_average_at_start")
    load_text = f", load average {load[0]:.2f}" if load else ""
    text = (
        f"{info['cpu_model']} ({info['available_cores']} of {info['cpu_count']} cores usable, "
        f"{info['memory_gib']} GiB){load_text}; torch {info['torch']}, lightning_zenflow "
        f"{info['lightning_zenflow']}, Python {info['python']}; device {info['device']} ({info['device_name']}); "
        f"{info['date']}"
    )
    if load and load[0] > 0.5 * max(1, info["available_cores"]):
        text += "\n  WARNING: the machine was busy when this run started; treat the timings as noisy."
    return text


@contextlib.contextmanager
def pinned(cores: Sequence[int], threads: int) -> Iterator[None]:
    """Run the block on ``cores`` with ``threads`` torch threads; restore both afterwards."""
    saved_affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    saved_threads = torch.get_num_threads()
    try:
        if saved_affinity is not None:
            os.sched_setaffinity(0, set(cores))
        torch.set_num_threads(threads)
        yield
    finally:
        if saved_affinity is not None:
            os.sched_setaffinity(0, saved_affinity)
        torch.set_num_threads(saved_threads)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: numbers with ``digits`` significant digits, None/NaN as '-'."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 10**digits:
            return f"{value:.0f}"
        return f"{value:.{digits}g}"
    return str(value)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> str:
    """A plain-text table, columns padded to width, numbers right-aligned."""
    cells = [[fmt(value, digits) for value in row] for row in rows]
    widths = [max([len(header)] + [len(row[i]) for row in cells]) for i, header in enumerate(headers)]

    def line(values: Sequence[str], numeric: Sequence[bool]) -> str:
        return "  ".join(v.rjust(w) if n else v.ljust(w) for v, w, n in zip(values, widths, numeric))

    numeric = [
        all(isinstance(row[i], (int, float)) and not isinstance(row[i], bool) for row in rows if row[i] is not None)
        for i in range(len(headers))
    ]
    out = [line(list(headers), [False] * len(headers)), "  ".join("-" * w for w in widths)]
    out.extend(line(row, numeric) for row in cells)
    return "\n".join(out)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def write_json(path: pathlib.Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` (NaN/inf become null) to ``path``, creating its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_json_safe(payload), indent=2) + "\n")
    print(f"wrote {path}")


def append_jsonl(path: pathlib.Path, record: dict[str, Any]) -> None:
    """Append ``record`` as one JSON line to ``path`` and push it to disk now, so a run killed later keeps it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        handle.write(json.dumps(_json_safe(record)) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def matplotlib_pyplot() -> Any | None:
    """``matplotlib.pyplot`` with a file-only backend, or None (with a message) when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install 'lightning-zenflow[plot]').")
        return None
    return plt


def save_figure(plt: Any, figure: Any, axes: Any, path: pathlib.Path, title: str) -> None:
    """Title, legend, tight layout, write the PNG, close the figure, say where it went."""
    axes.set_title(title, fontsize=9)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def command_line() -> str:
    """The command that produced this run, for the JSON."""
    return " ".join([pathlib.Path(sys.executable).name, *sys.argv])
