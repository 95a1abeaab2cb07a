"""The report of ``offload_bench.py``: per-configuration summaries from the raw per-step records, the printed
tables, the target checks and the plot. No measurement happens here."""

from __future__ import annotations

import math
import pathlib
from typing import Any

import bench_utils


def summarize(results: list[dict[str, Any]], model_bytes: int, n_params: int) -> dict[str, dict[str, Any]]:
    """The per-configuration numbers of the report, derived from the raw per-step records."""
    by_name = {r["name"]: r for r in results}
    fwd_bwd = bench_utils.median(by_name["fwd+bwd"]["step_s"]) if "fwd+bwd" in by_name else math.nan
    no_offload = bench_utils.median(by_name["no-offload"]["step_s"]) if "no-offload" in by_name else math.nan
    sync = bench_utils.median(by_name["sync-offload"]["step_s"]) if "sync-offload" in by_name else math.nan
    ideal = sync / no_offload
    summary = {}
    for r in results:
        step_median = bench_utils.median(r["step_s"])
        step_p99 = bench_utils.percentile(r["step_s"], 99)
        row: dict[str, Any] = {
            "median_step_s": step_median,
            "p99_step_s": step_p99,
            "p99_over_median": step_p99 / step_median,
            "ratio_to_no_offload": step_median / no_offload,
            "speedup_over_sync_offload": sync / step_median,
            "ideal_speedup_over_sync_offload": ideal,
            # speedup / ideal (which equals no-offload / this step: the "practicality" of the paper's peers)
            "fraction_of_ideal_speedup": (sync / step_median) / ideal,
            # share of the possible gain recovered: 0 = as slow as sync-offload, 1 = as fast as no-offload
            "gain_recovered": (sync / step_median - 1.0) / (ideal - 1.0) if ideal > 1.0 else math.nan,
        }
        device_update = bench_utils.median(r.get("device_update_s", []))
        if r["kind"] in ("engine", "no-offload"):
            row["device_update_median_s"] = device_update
            row["fwd_bwd_plus_device_update_s"] = fwd_bwd + device_update
            row["step_over_fwd_bwd_plus_device_update"] = step_median / (fwd_bwd + device_update)
        if "stall_s" in r:
            row["stall_share"] = sum(r["stall_s"]) / r["wall_s"]
            row["host_update_median_s"] = bench_utils.median(r["host_update_s"])
            row["pcie_bytes_per_step"] = (sum(r["d2h_bytes"]) + sum(r["h2d_bytes"])) / len(r["d2h_bytes"])
            row["pcie_over_model_bytes"] = row["pcie_bytes_per_step"] / model_bytes
            row["d2h_over_model_bytes"] = sum(r["d2h_bytes"]) / len(r["d2h_bytes"]) / model_bytes
            row["h2d_over_model_bytes"] = sum(r["h2d_bytes"]) / len(r["h2d_bytes"]) / model_bytes
            rho, interval = r["topk_ratio"], r["update_interval"]
            row["accumulate_on"] = r.get("accumulate_on")
            weight_bytes = model_bytes / n_params
            if row["accumulate_on"] == "device":
                # the window's sum down and its step up once per window, a B each (2 in the compact state, 4 in the
                # exact one; docs/performance.md)
                window = 4.0 if r.get("host_state") == "fp32" else 2.0
                row["pcie_budget"] = 2.0 * window / weight_bytes / interval
            else:
                # the unselected columns down every step, the fp32 step up once per window
                row["pcie_budget"] = (1.0 - rho) + 4.0 / weight_bytes / interval
        elif r["kind"] == "no-offload":
            row["stall_share"] = 0.0
            row["pcie_over_model_bytes"] = 0.0
        row["device_bytes_per_param"] = None if r["device_bytes"] is None else r["device_bytes"] / n_params
        row["host_bytes_per_param"] = None if r["host_bytes"] is None else r["host_bytes"] / n_params
        if "peak_device_memory_bytes" in r:
            row["peak_device_memory_gib"] = r["peak_device_memory_bytes"] / 2**30
        summary[r["name"]] = row
    return summary


TIMING_COLUMNS = (
    ("median ms", "median_step_s", 1e3), ("p99 ms", "p99_step_s", 1e3), ("p99/med", "p99_over_median", 1),
    ("x no-offload", "ratio_to_no_offload", 1), ("speedup vs sync", "speedup_over_sync_offload", 1),
    ("of ideal", "fraction_of_ideal_speedup", 1), ("gain recovered", "gain_recovered", 1),
    ("stall %", "stall_share", 100), ("step/(fb+dev)", "step_over_fwd_bwd_plus_device_update", 1),
)  # fmt: skip
TRAFFIC_COLUMNS = (
    ("PCIe/model B", "pcie_over_model_bytes", 1), ("budget", "pcie_budget", 1),
    ("device B/param", "device_bytes_per_param", 1), ("host B/param", "host_bytes_per_param", 1),
    ("dev upd ms", "device_update_median_s", 1e3), ("host upd ms", "host_update_median_s", 1e3),
)  # fmt: skip
"""The printed tables' columns: header, summary key, scale (a key a row lacks prints as '-')."""


def print_report(results: list[dict[str, Any]], summary: dict[str, dict[str, Any]], is_cuda: bool) -> None:
    traffic = TRAFFIC_COLUMNS + ((("peak GiB", "peak_device_memory_gib", 1),) if is_cuda else ())
    for title, columns in (
        ("\nStep time (median and p99 over the measured steps)", TIMING_COLUMNS),
        ("\nTraffic and memory (bytes per step over model bytes; optimizer bytes per parameter)", traffic),
    ):
        rows = []
        for r in results:
            values = [summary[r["name"]].get(key) for _, key, _ in columns]
            rows.append([r["name"], *(None if v is None else v * scale for v, (*_, scale) in zip(values, columns))])
        bench_utils.print_table(title, ["config", *(header for header, _, _ in columns)], rows)


def target_checks(summary: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The project targets this benchmark can check, for the default 'zenflow' row."""
    z = summary.get("zenflow")
    if z is None:
        return {}
    return {
        "zenflow_step_within_1.15x_of_fwd_bwd_plus_device_update": z["step_over_fwd_bwd_plus_device_update"] <= 1.15,
        "zenflow_p99_over_median_le_1.3": z["p99_over_median"] <= 1.3,
        "zenflow_stall_share_le_0.15": z["stall_share"] <= 0.15,
        "zenflow_pcie_within_budget": z["pcie_over_model_bytes"] <= z["pcie_budget"] + 1e-9,
        "zenflow_host_bytes_per_param_le_20": z["host_bytes_per_param"] <= 20.0,
        "zenflow_speedup_over_sync_offload": z["speedup_over_sync_offload"],
        "practicality_no_offload_over_zenflow": 1.0 / z["ratio_to_no_offload"],
    }


def plot(results: list[dict[str, Any]], summary: dict[str, dict[str, Any]], path: pathlib.Path, title: str) -> None:
    plt = bench_utils.matplotlib_pyplot()
    if plt is None:
        return
    names = [r["name"] for r in results]
    medians = [summary[n]["median_step_s"] * 1e3 for n in names]
    p99s = [summary[n]["p99_step_s"] * 1e3 for n in names]
    figure, axes = plt.subplots(figsize=(max(6.0, 0.7 * len(names) + 2), 4.5))
    positions = range(len(names))
    axes.bar(positions, medians, color="tab:blue", label="median")
    axes.scatter(positions, p99s, color="tab:red", marker="_", s=300, label="p99", zorder=3)
    axes.set_xticks(list(positions))
    axes.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    axes.set_ylabel("step time (ms)")
    bench_utils.save_figure(plt, figure, axes, path, title)
