"""The frame every benchmark script shares: arguments, the machine line, core pinning, statistics, tables, the JSON
footer, plots; and the training pieces several use (the demo's AdamW groups, seeded builds, token windows, optimizer
bytes, a median timer).

Not a benchmark itself. The scripts import it as ``bench_utils`` (Python puts the script's folder on ``sys.path``). It
imports torch only: the engine's spawned host worker re-imports the running script's top level, which should stay
cheap. A script's frame::

    parser = bench_utils.make_parser(__doc__)
    bench_utils.add_common_args(parser, out=DEFAULT_OUT, quick="...")   # --quick, --out (and --seed, --plot, --device)
    ...                                                                  # the script's own flags
    args = parser.parse_args(argv)
    bench_utils.apply_quick_defaults(args, {"steps": (200, 24)})        # flags left unset: full or quick value
    info = bench_utils.announce("name: what it measures", device)       # the title and the machine line
    ...                                                                  # what the script measures
    bench_utils.write_results(args.out, bench_utils.payload("name", info, runs=...))
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

T = TypeVar("T")


# ------------------------------------------------------------------------------------------------------- arguments


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """The block runs with ``values`` set in ``os.environ``; they are put back after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def make_parser(description: str | None) -> argparse.ArgumentParser:
    """The script's parser; ``--help`` prints ``description`` (the module docstring) as written."""
    return argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_common_args(
    parser: argparse.ArgumentParser,
    *,
    out: pathlib.Path,
    out_help: str = "JSON output path.",
    quick: str | None = None,
    seed: str | None = None,
    plot: str | None = None,
    device: Sequence[str] | None = None,
    device_help: str | None = None,
) -> None:
    """The flags several scripts share, with each script's default and help text.

    ``--out`` (``out`` is the default path) always; ``--quick`` when ``quick`` (its help) is given; ``--seed``
    (int, default 0) when ``seed`` is given ("" for no help text); ``--plot`` when ``plot`` (its help) is given;
    ``--device`` when ``device`` lists the choices (the first is the default).
    """
    if device is not None:
        parser.add_argument("--device", choices=tuple(device), default=device[0], help=device_help)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--out", type=pathlib.Path, default=out, help=out_help)
    if plot is not None:
        parser.add_argument("--plot", action="store_true", help=plot)
    if seed is not None:
        parser.add_argument("--seed", type=int, default=0, help=seed or None)


def apply_quick_defaults(args: argparse.Namespace, defaults: Mapping[str, tuple[Any, Any]]) -> argparse.Namespace:
    """Every flag of ``defaults`` (``{dest: (full, quick)}``) left unset (None) takes its full or its --quick value."""
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def whole_windows(steps: int, interval: int) -> int:
    """``steps`` rounded up to a multiple of ``interval``: warm-up and measurement end at window ends, so bytes per
    step and stall are window averages."""
    return interval * math.ceil(steps / interval)


def cuda_missing(device: str, hint: str) -> str | None:
    """The message for ``--device cuda`` on a machine without CUDA (``hint``: what to run instead), or None."""
    if device != "cuda" or torch.cuda.is_available():
        return None
    return (
        f"--device cuda needs a CUDA GPU, but torch.cuda.is_available() is False here (torch {torch.__version__}){hint}"
    )


def settings_of(args: argparse.Namespace, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The parsed arguments for the JSON (paths as strings), less ``skip``."""
    return {k: (str(v) if isinstance(v, pathlib.Path) else v) for k, v in vars(args).items() if k not in skip}


# --------------------------------------------------------------------------------------------------- the machine
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
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
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


def announce(title: str, device: torch.device) -> dict[str, Any]:
    """Print the script's title and the machine line (what it runs on); return the machine info for the JSON."""
    info = machine_info(device)
    print(title)
    print(f"machine: {describe_machine(info)}")
    return info


def load_average() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def git_revision() -> str | None:
    """The commit of the checkout, marked when the package's files differ from it (None outside a git checkout)."""
    root = pathlib.Path(__file__).resolve().parents[1]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "lightning_zenflow"], cwd=root, capture_output=True, text=True
        )
        if head.returncode == 0:
            return head.stdout.strip() + (" (lightning_zenflow modified)" if dirty.stdout.strip() else "")
    return None


@contextlib.contextmanager
def pinned(cores: Sequence[int], threads: int | None = None) -> Iterator[None]:
    """Run the block on ``cores`` with ``threads`` torch threads (default: one per core); restore both afterwards.

    The engine pins its training process this way; the reference rows of a comparison do the same, so forward and
    backward get the same compute in every row."""
    threads = len(cores) if threads is None else threads
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


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def pm(values: Sequence[float], digits: int, suffix: str = "") -> str:
    """``mean ± std`` of ``values`` (the mean alone for one value); a signed mean when ``suffix`` is ``" %"``."""
    mean, std = mean_std(values)
    sign = "+" if suffix == " %" else ""
    return f"{mean:{sign}.{digits}f}" + ("" if std is None else f" ± {std:.{digits}f}") + suffix


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


def print_table(title: str | None, headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 3) -> None:
    """Print ``title`` (when given) and the rows side by side under ``headers`` (``format_table``)."""
    if title is not None:
        print(title)
    print(format_table(headers, rows, digits))


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


def write_partial(path: pathlib.Path, payload: dict[str, Any]) -> None:
    """Write what a long run has measured so far next to ``path`` (``<out>.partial.json``), quietly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_suffix(".partial.json").write_text(json.dumps(_json_safe(payload)))


def payload(benchmark: str, info: dict[str, Any], *, revision: bool = False, **results: Any) -> dict[str, Any]:
    """A result file: the benchmark's name, the command line, the checkout's revision (when asked), the machine
    (with the date the run started) and then ``results`` in the order given."""
    head: dict[str, Any] = {"benchmark": benchmark, "command": command_line()}
    if revision:
        head["revision"] = git_revision()
    return {**head, "machine": info, **results}


def write_results(path: pathlib.Path, result: dict[str, Any]) -> None:
    """Write a ``payload`` to ``path``: the machine's load average at the end is recorded first (unless the script
    already did), and a partial file of the same run is removed."""
    if isinstance(result.get("machine"), dict):
        result["machine"].setdefault("load_average_at_end", load_average())
    write_json(path, result)
    path.with_suffix(".partial.json").unlink(missing_ok=True)


def attempt(name: str, run: Callable[[], T]) -> tuple[T | None, dict[str, str] | None]:
    """One configuration of a comparison: prints ``[name] running ...`` and returns ``(run(), None)``; an exception
    is printed and returned as ``(None, failure)`` (name, error, traceback), so the script goes on with the next."""
    print(f"[{name}] running ...", end="", flush=True)
    try:
        return run(), None
    except Exception as error:  # record it and go on: one GPU run should report every configuration it can
        print(f" FAILED: {type(error).__name__}: {error}")
        error_text = f"{type(error).__name__}: {error}"
        return None, {"name": name, "error": error_text, "traceback": traceback.format_exc()[-4000:]}


def report_failures(failures: Sequence[Mapping[str, Any]], noun: str, label: Callable[[Mapping[str, Any]], str]) -> int:
    """Name the failed configurations (``noun``: what failed) and return the exit status: 1 if any failed, else 0."""
    if not failures:
        return 0
    print(f"{len(failures)} {noun} failed: " + "; ".join(f"{label(f)}: {f['error']}" for f in failures))
    return 1


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


# ------------------------------------------------------------------------------------------- training pieces
def decay_groups(params: Iterable[torch.Tensor]) -> list[dict[str, Any]]:
    """The demo's two groups: matrices and embeddings with weight decay 0.1, biases and norms without."""
    params = list(params)
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def demo_adamw(params: Iterable[torch.Tensor], lr: float, **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over ``decay_groups`` with the demo's betas (0.9, 0.95) and eps 1e-8."""
    return torch.optim.AdamW(decay_groups(params), lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in the optimizer's state (moments, step counts)."""
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))


def build_seeded(build: Callable[[], T], seed: int) -> T:
    """``build()`` under ``torch.manual_seed(seed)``, the caller's random state untouched: the same initial weights
    for every configuration of a comparison."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # seeds the CUDA generator too
        return build()


def windows(tokens: torch.Tensor, starts: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets: the ``block + 1`` tokens from each of ``starts``, shifted by one."""
    index = starts.reshape(-1, 1) + torch.arange(block + 1)
    window = tokens[index].long()
    return window[:, :-1], window[:, 1:]


def time_median(
    fn: Callable[[], Any],
    repeats: int,
    *,
    warmups: int = 1,
    prepare: Callable[[], None] | None = None,
    device: torch.device | None = None,
) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after ``warmups`` untimed ones; ``prepare()`` runs untimed
    before each call. On CUDA the clock waits for queued work before and after each call, so it sees ``fn`` alone."""
    cuda = device is not None and device.type == "cuda"
    times = []
    for index in range(warmups + repeats):
        if prepare is not None:
            prepare()
        if cuda:
            torch.cuda.synchronize(device)  # timing only: queued work has finished before the clock starts
        started = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize(device)  # timing only: fn's kernels have finished
        if index >= warmups:
            times.append(time.perf_counter() - started)
    return statistics.median(times)
