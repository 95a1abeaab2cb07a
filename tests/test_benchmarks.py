"""The benchmark scripts run in ``--quick`` mode, print their tables and write well-formed JSON (CPU, ~2 min).

Each script's ``main`` runs in this process with the arguments a user types (``python benchmarks/x.py --quick --out
...``): the script pays no second import of torch and Lightning, and its host workers and ranks are spawned as a user's
run spawns them. One test runs a script as a user does, from the command line, for its error message. Timings are not
checked (the machine may be busy), only that every number the report is built from is there, finite and positive, and
that the accounting is self-consistent.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
TIMEOUT_S = 300

pytestmark = pytest.mark.slow


def run_main(script: str, *argv: str) -> tuple[int, str]:
    """``benchmarks/<script>.py`` as ``python benchmarks/<script>.py *argv`` runs it, but in this process: its exit code
    and what it printed. The process's torch threads, random state and working directory are restored after."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))  # where the scripts find bench_utils and their other siblings
    module = importlib.import_module(script)
    threads, rng, cwd = torch.get_num_threads(), torch.get_rng_state(), os.getcwd()
    printed = io.StringIO()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(printed):
            code = module.main(list(argv))
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    return code, printed.getvalue()


def run_quick(script: str, tmp_path: pathlib.Path, *extra: str) -> tuple[str, dict[str, Any], pathlib.Path]:
    out = tmp_path / f"{script}.json"
    code, stdout = run_main(script, "--quick", "--out", str(out), *extra)
    assert code == 0, f"{script} failed:\n{stdout[-4000:]}"
    assert out.exists(), f"{script} wrote no JSON at {out}"
    return stdout, json.loads(out.read_text()), out


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def check_machine(info: dict[str, Any]) -> None:
    for key in ("cpu_model", "cpu_count", "torch", "device", "device_name", "date"):
        assert info.get(key), f"machine info lacks {key}"


def test_offload_bench_quick(tmp_path: pathlib.Path) -> None:
    stdout, result, out = run_quick("offload_bench", tmp_path, "--plot")
    assert "CPU SURROGATE" in stdout
    for header in ("Step time", "median ms", "speedup vs sync", "Traffic and memory", "PCIe/model B"):
        assert header in stdout
    check_machine(result["machine"])
    assert result["cpu_surrogate"] is True
    assert result["warmup_steps"] > 0
    assert result["measured_steps"] > 0
    assert result["calibration"]["candidates"], "the calibration measured nothing"
    for candidate in result["calibration"]["candidates"]:
        assert positive(candidate["fwd_bwd_s"])
        assert positive(candidate["adamw_s"])
    configs = {config["name"]: config for config in result["configs"]}
    assert set(configs) == {
        "fwd+bwd",
        "no-offload",
        "sync-offload",
        "zenflow",
        "zenflow fp32",
        "zenflow no-moves",
        "zenflow host",
    }
    for name, config in configs.items():
        summary = config["summary"]
        assert len(config["step_s"]) == result["measured_steps"], name
        for key in (
            "median_step_s",
            "p99_step_s",
            "p99_over_median",
            "ratio_to_no_offload",
            "speedup_over_sync_offload",
            "ideal_speedup_over_sync_offload",
            "fraction_of_ideal_speedup",
        ):
            assert positive(summary[key]), f"{name}: {key} = {summary[key]}"
    assert [configs[name].get("accumulate_on") for name in ("sync-offload", "zenflow", "zenflow host")] == [
        "host",
        "device",
        "host",
    ]
    assert configs["zenflow"]["interim_step"] == "auto"
    assert configs["zenflow no-moves"]["interim_step"] == 0
    for name in ("sync-offload", "zenflow", "zenflow no-moves", "zenflow host"):
        summary = configs[name]["summary"]
        for key in ("pcie_over_model_bytes", "pcie_budget", "host_bytes_per_param", "wall_s"):
            value = summary.get(key, configs[name].get(key))
            assert positive(value), f"{name}: {key} = {value}"
        assert 0.0 <= summary["stall_share"] <= 1.0
        # bytes are counted at the engine's copy sites: at most the design's budget (device-only params stay put)
        assert summary["pcie_over_model_bytes"] <= summary["pcie_budget"] * 1.001
        assert positive(summary["step_over_fwd_bwd_plus_device_update"])
    assert 1.8 < configs["sync-offload"]["summary"]["pcie_over_model_bytes"] <= 2.0 + 1e-9
    assert configs["no-offload"]["summary"]["device_bytes_per_param"] == pytest.approx(8.0, rel=0.01)
    assert result["targets"], "no target checks for the zenflow row"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipping the plot" in stdout
    else:
        assert out.with_suffix(".png").exists()


def test_ddp_bench_quick(tmp_path: pathlib.Path) -> None:
    """``ddp_bench.py --quick``: 1 rank against 2 gloo ranks, device mode. The bytes are exact, so they are checked:
    each of two ranks holds and moves half of what one rank does (the quick model's row counts are even)."""
    stdout, result, _ = run_quick("ddp_bench", tmp_path)
    for header in ("CPU ONLY", "Per rank", "2 ranks / 1 rank", "host/rank", "d2h MiB/step"):
        assert header in stdout
    check_machine(result["machine"])
    assert result["failures"] == []
    assert [launch["exit_codes"] for launch in result["launches"]] == [[0], [0, 0]]
    settings = result["settings"]
    summary = result["summary"]
    assert set(summary) == {"device 1/0", "device 2/0", "device 2/1"}
    for record in result["records"]:
        assert record["accumulate_on"] == "device"
        assert len(record["step_s"]) == len(record["d2h_bytes"]) == settings["measured_steps"]
        assert settings["measured_steps"] % settings["update_interval"] == 0, "whole windows are measured"
    for name, entry in summary.items():
        for key in ("host_bytes", "device_bytes", "median_step_s", "p99_step_s", "eval_loss"):
            assert positive(entry[key]), f"{name}: {key} = {entry[key]}"
        assert 0.0 <= entry["stall_share"] <= 1.0
    for name in ("device 2/0", "device 2/1"):
        assert positive(summary[name]["median_allreduce_s"])
    # device mode, the compact state: the bf16 accumulator down and the bf16 step up, once per window of 4, of every
    # matrix's own rows
    width, layers = settings["width"], settings["layers"]
    matrix_elements = (8 * layers + 1) * width * width  # per block d x 4d twice, and the d x d head
    one = summary["device 1/0"]
    assert one["d2h_bytes_per_step"] == pytest.approx(matrix_elements * 2 / 4)
    assert one["h2d_bytes_per_step"] == pytest.approx(matrix_elements * 2 / 4)
    ratios = result["ratios_2_over_1"]["device"]
    assert ratios["d2h_per_rank"] == pytest.approx(0.5)
    assert ratios["h2d_per_rank"] == pytest.approx(0.5)
    assert ratios["host_bytes_per_rank"] == pytest.approx(0.5, rel=0.01)
    assert ratios["host_bytes_per_machine"] == pytest.approx(1.0, rel=0.01)
    # the same training: the ranks agree, and 2 ranks equal 1 rank up to the order of float additions
    assert summary["device 2/0"]["weights_checksum"] == summary["device 2/1"]["weights_checksum"]
    assert ratios["eval_loss_relative_difference"] < 1e-5
    assert ratios["weights_sum_relative_difference"] < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error message on a machine without CUDA")
def test_offload_bench_cuda_fails_clearly_without_cuda(tmp_path: pathlib.Path) -> None:
    process = subprocess.run(
        [sys.executable, str(BENCHMARKS / "offload_bench.py"), "--device", "cuda", "--out", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=ROOT,
    )
    assert process.returncode != 0
    assert "--device cuda needs a CUDA GPU" in process.stderr
    assert "Traceback" not in process.stderr


def test_kernel_bench_quick(tmp_path: pathlib.Path) -> None:
    stdout, result, _ = run_quick("kernel_bench", tmp_path)
    for header in (
        "Host AdamW throughput",
        "engine/AdamW",
        "Host add of accumulate_on='host'",
        "interim moves' passes",
    ):
        assert header in stdout
    check_machine(result["machine"])
    assert result["results"]
    for record in result["results"]:
        for key in (
            "engine_s",
            "engine_params_per_s",
            "engine_gb_per_s",
            "fused_adamw_s",
            "fused_adamw_gb_per_s",
            "ratio_to_fused_adamw",
            "copy_gb_per_s",
            "engine_fraction_of_copy_bandwidth",
        ):
            assert positive(record[key]), f"{key} = {record[key]}"
    assert positive(result["results"][0]["worker_compute_s"])
    assert positive(result["results"][0]["worker_wall_s"])
    assert result["bytes_per_param"] == {"engine": 12, "fused_adamw": 28, "copy": 8, "add_": 12}
    assert result["host_state"] == "bf16"
    for record in result["host_add"]:
        assert positive(record["engine_fp32_ratio_to_plain_add"])
    passes = result["moves_pass_ms"]
    assert {"fused AdamW step", "moves eager fp32", "moves eager bf16"} <= set(passes)
    assert all(positive(value) for value in passes.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error message on a machine without CUDA")
def test_kernel_bench_cuda_fails_clearly_without_cuda(tmp_path: pathlib.Path) -> None:
    code, stdout = run_main("kernel_bench", "--device", "cuda", "--out", str(tmp_path / "x.json"))
    assert code == 2
    assert not (tmp_path / "x.json").exists()


def test_offload_bench_profiles_the_zenflow_row(tmp_path: pathlib.Path) -> None:
    """``--profile``: the zenflow row alone, its measured steps in a Chrome trace (what the GPU run records)."""
    trace = tmp_path / "trace.json"
    stdout, result, _ = run_quick("offload_bench", tmp_path, "--steps", "4", "--profile", str(trace))
    assert [config["name"] for config in result["configs"]] == ["zenflow"]
    assert f"Chrome trace of 4 steps of zenflow to {trace}" in stdout
    names = {event.get("name", "") for event in json.loads(trace.read_text())["traceEvents"]}
    assert {"aten::mm", "aten::addmm"} & names, "the forward and backward's matrix products are in the trace"


def test_plan_bench_quick(tmp_path: pathlib.Path) -> None:
    """``plan_bench.py --quick``: the planner's step against the measured one for synchronous offload and the
    defaults. Whether a prediction lands within the target depends on the machine's load; the exit status must say
    whether they all did, and every number the comparison is built from must be there."""
    out = tmp_path / "plan_bench.json"
    code, stdout = run_main("plan_bench", "--quick", "--out", str(out))
    result = json.loads(out.read_text())
    assert "Predicted against measured step" in stdout
    check_machine(result["machine"])
    rows = {row["name"]: row for row in result["rows"]}
    assert set(rows) == {"sync-offload", "zenflow"}
    assert positive(result["measured_s"]["fwd+bwd"])
    for name, row in rows.items():
        assert positive(row["measured_s"]), name
        assert positive(row["predicted_s"]), name
        assert row["error"] == pytest.approx(row["predicted_s"] / row["measured_s"] - 1), name
        assert row["within_target"] == (abs(row["error"]) <= result["target"]), name
    assert code == (0 if all(row["within_target"] for row in rows.values()) else 1)
    assert result["rates"], "plan --measure measured no rate"


def test_finetune_quality_quick(tmp_path: pathlib.Path) -> None:
    stdout, result, _ = run_quick("finetune_quality", tmp_path, "--cache", str(tmp_path / "cache"))
    for header in ("Main rows", "Held-out loss during fine-tuning", "Gradient concentration", "sync-offload vs AdamW"):
        assert header in stdout
    check_machine(result["machine"])
    assert result["base"]["cached"] is False  # a fresh cache folder: the base was pre-trained here
    summary = result["summary"]
    assert {"adamw", "sync-offload", "zenflow"} <= set(summary)
    finetune_steps = result["settings"]["finetune_steps"]
    for name, entry in summary.items():
        assert entry["eval_steps"][0] == 0, name
        assert entry["eval_steps"][-1] == finetune_steps, name
        assert all(positive(loss) for loss in entry["mean_eval_loss"]), name
        times = entry["mean_eval_train_s"]
        assert times == sorted(times), f"{name}: wall times must not go back"
    for run in result["runs"]:
        assert len(run["train_loss"]) == finetune_steps, run["row"]
    # the design's degenerate case, recomputed from the raw runs: synchronous offload is AdamW up to float rounding
    adamw = {run["seed"]: run["final_eval_loss"] for run in result["runs"] if run["row"] == "adamw"}
    sync = [run for run in result["runs"] if run["row"] == "sync-offload"]
    assert sync
    for run in sync:
        assert run["final_eval_loss"] == pytest.approx(adamw[run["seed"]], rel=1e-3)
    assert result["sync_offload_matches_adamw"] is True
    # the premise statistics: shares are fractions, the top 10 % holds at least the top 1 %, overlaps are in [0, 1]
    steps = result["gradient_statistics"]["steps"]
    assert len(steps) >= 2
    for entry in steps:
        assert 0.0 < entry["top0.01"] <= entry["top0.1"] <= 1.0
    assert all(0.0 <= entry["jaccard_prev"] <= 1.0 for entry in steps[1:])


@pytest.mark.slow
def test_finetune_quality_sweeps_rates_and_reports_best_against_best(tmp_path: pathlib.Path) -> None:
    """``--lrs``: every row at every rate, a ``--row`` of one's own among them; the best rate and the paired gap at it
    are recomputed from the raw runs."""
    extra = ("--cache", str(tmp_path / "cache"), "--lrs", "1e-3", "4e-3", "--main-rows", "zenflow")
    own = ("--row", 'S8-k1={"update_interval": 8, "interim_step": 1.0}')
    stdout, result, _ = run_quick("finetune_quality", tmp_path, *extra, "--ablations", "zenflow-S8", *own)
    assert "Best against best" in stdout
    assert "per peak rate" in stdout
    names = ("adamw", "zenflow", "zenflow-S8", "S8-k1")
    assert result["rows"]["S8-k1"]["knobs"] == {"update_interval": 8, "interim_step": 1.0}
    runs = result["runs"]
    assert sorted({(run["optimizer"], run["lr"]) for run in runs}) == sorted(
        (name, lr) for name in names for lr in (1e-3, 4e-3)
    )
    final = {(run["optimizer"], run["lr"]): run["final_eval_loss"] for run in runs}  # one seed in --quick
    assert final["S8-k1", 1e-3] != final["zenflow-S8", 1e-3]  # the knob reached the engine
    best = result["best_of_rates"]
    for name in names:
        best_lr = min((1e-3, 4e-3), key=lambda lr: final[name, lr])
        assert best[name]["best_lr"] == best_lr
        expected = 100 * (final[name, best_lr] / final["adamw", best["adamw"]["best_lr"]] - 1)
        assert best[name]["best_gap_percent"] == [pytest.approx(expected)]
        assert all(ratio >= 1.0 for ratio in best[name]["worst_ratio_to_adamw_by_lr"].values())  # step 0: the base


def test_real_lm_sweeps_rates_and_seeds(tmp_path: pathlib.Path) -> None:
    """``real_lm.py --lrs --seeds``: every row at every rate and seed (a seed is a batch order), a constant schedule,
    and best against best from the shared ``rate_sweep`` summary, recomputed here from the raw runs."""
    pytest.importorskip("transformers")
    extra = ("--lrs", "2e-3", "4e-3", "--seeds", "2", "--schedule", "constant", "--rows", "adamw", "zenflow", "s8")
    stdout, result, _ = run_quick("real_lm", tmp_path, "--row", 's8={"update_interval": 8}', *extra)
    assert "Best against best" in stdout
    runs = result["runs"]
    cells = sorted((run["row"], run["lr"], run["seed"]) for run in runs)
    assert cells == sorted(
        (row, lr, seed) for row in ("adamw", "zenflow", "s8") for lr in (2e-3, 4e-3) for seed in (0, 1)
    )
    final = {(run["row"], run["lr"], run["seed"]): run["final_heldout_loss"] for run in runs}
    assert final["adamw", 2e-3, 0] != final["adamw", 2e-3, 1]  # the seeds are different batch orders
    best = result["best_of_rates"]
    adamw_lr = min((2e-3, 4e-3), key=lambda lr: final["adamw", lr, 0] + final["adamw", lr, 1])
    for row in ("zenflow", "s8"):
        lr = min((2e-3, 4e-3), key=lambda lr: final[row, lr, 0] + final[row, lr, 1])
        assert best[row]["best_lr"] == lr
        expected = [100 * (final[row, lr, seed] / final["adamw", adamw_lr, seed] - 1) for seed in (0, 1)]
        assert best[row]["best_gap_percent"] == pytest.approx(expected)
        for run in runs:
            if run["row"] == row:
                paired = final["adamw", run["lr"], run["seed"]]
                assert run["gap_to_adamw_pct"] == pytest.approx(100 * (run["final_heldout_loss"] / paired - 1))


def test_real_lm_quick(tmp_path: pathlib.Path) -> None:
    """The real-LLM benchmark's smoke run: a tiny random Llama on byte tokens (no download), AdamW against ZenFlow
    through the Trainer, the held-out curve and the paired gap."""
    pytest.importorskip("transformers")
    stdout, result, _ = run_quick("real_lm", tmp_path)
    rows = {run["row"]: run for run in result["runs"]}
    assert set(rows) == {"adamw", "zenflow"}
    for run in rows.values():
        assert math.isfinite(run["final_heldout_loss"])
        assert run["final_heldout_loss"] < result["base_heldout_loss"], f"{run['row']} did not learn"
    gap = 100 * (rows["zenflow"]["final_heldout_loss"] / rows["adamw"]["final_heldout_loss"] - 1)
    assert rows["zenflow"]["gap_to_adamw_pct"] == pytest.approx(gap, rel=1e-6, abs=1e-9)
    assert "gap to adamw" in stdout
    # both moved their matrices; an interim move per unit step is bounded by the clip (AdamW's first step: 1)
    assert all(run["travel"] > 0 for run in rows.values())
    for kind in result["premise"]["kinds"].values():
        assert 0.0 < kind["share"] <= 1.0
        assert 0.0 < kind["move"] <= 1.0


def test_real_lm_moe_quick(tmp_path: pathlib.Path) -> None:
    """``real_lm.py --quick --model moe --pretrain-steps``: a tiny Qwen3-MoE on byte tokens pre-trained on the standard
    library's code (cached: the second run reads it back) and fine-tuned with AdamW and ZenFlow. The engine views each
    fused expert parameter ``[E, out, in]`` as the matrix ``[E x out, in]``, and experts no token reached at a step
    (zero gradient slices) are counted, and occur."""
    pytest.importorskip("transformers")
    extra = ("--model", "moe", "--pretrain-steps", "8", "--cache", str(tmp_path / "cache"))
    stdout, result, _ = run_quick("real_lm", tmp_path, *extra)
    assert result["pretrained_base"]["cached"] is False
    assert "the engine's matrix view of each fused expert parameter" in stdout
    rows = {run["row"]: run for run in result["runs"]}
    assert set(rows) == {"adamw", "zenflow"}
    views = rows["zenflow"]["expert_matrices"]
    assert len(views) == 2 * result["model_config"]["num_hidden_layers"]  # gate_up_proj and down_proj per layer
    for name, view in views.items():
        experts, out, columns = view["shape"]
        assert view["matrix"] == [experts * out, columns], name
    for run in rows.values():
        assert len(run["unreached_experts"]) == result["settings"]["steps"]
        assert any(run["unreached_experts"]), f"{run['row']}: every expert was reached at every step"
        assert run["final_heldout_loss"] < result["base_heldout_loss"], f"{run['row']} did not learn"
    assert {"experts.gate_up_proj", "experts.down_proj", "mlp.gate"} <= set(result["premise"]["kinds"])
    _, again, _ = run_quick("real_lm", tmp_path, *extra, "--rows", "adamw")
    assert again["pretrained_base"]["cached"] is True
    assert again["base_heldout_loss"] == result["base_heldout_loss"]
