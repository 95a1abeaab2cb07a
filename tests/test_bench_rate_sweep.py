"""``benchmarks/rate_sweep.py``, best against best in the quality benchmarks' ``--lrs`` sweeps and their ``--row
NAME=JSON`` flag: on hand-made records whose answers are worked out here. CPU, no training, well under a second."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import rate_sweep  # noqa: E402


def _record(row: str, lr: float, seed: int, curve: list[float]) -> dict:
    return {"optimizer": row, "lr": lr, "seed": seed, "eval_loss": curve, "final_eval_loss": curve[-1]}


def _records() -> list[dict]:
    """AdamW best at 1e-3; "z" best at 5e-4 (a lower rate than AdamW's), with a spike at 2e-3 seed 1."""
    return [
        _record("adamw", 5e-4, 0, [3.0, 2.6, 2.5, 2.4, 2.30, 2.20]),
        _record("adamw", 5e-4, 1, [3.0, 2.6, 2.5, 2.4, 2.30, 2.22]),
        _record("adamw", 1e-3, 0, [3.0, 2.5, 2.4, 2.3, 2.20, 2.10]),
        _record("adamw", 1e-3, 1, [3.0, 2.5, 2.4, 2.3, 2.20, 2.14]),
        _record("z", 5e-4, 0, [3.0, 2.5, 2.4, 2.3, 2.20, 2.079]),
        _record("z", 5e-4, 1, [3.0, 2.5, 2.4, 2.3, 2.20, 2.14]),
        _record("z", 1e-3, 0, [3.0, 2.5, 2.4, 2.3, 2.25, 2.15]),
        _record("z", 1e-3, 1, [3.0, 3.0, 2.4, 2.3, 2.25, 2.15]),
    ]


def test_best_rate_paired_gap_tail_gap_and_worst_ratio() -> None:
    best = rate_sweep.best_of_rates(_records())
    assert best["adamw"]["best_lr"] == 1e-3
    assert best["adamw"]["mean_by_lr"] == {5e-4: pytest.approx(2.21), 1e-3: pytest.approx(2.12)}
    assert best["z"]["best_lr"] == 5e-4  # mean 2.1095 against 2.15 at 1e-3
    # paired by seed against AdamW at AdamW's own best rate, not at the row's rate
    assert best["z"]["best_gap_percent"] == [pytest.approx(100 * (2.079 / 2.10 - 1)), pytest.approx(0.0)]
    tail_z, tail_adamw = (2.4 + 2.3 + 2.2 + 2.079) / 4, (2.4 + 2.3 + 2.2 + 2.1) / 4  # the last four, seed 0
    assert best["z"]["best_tail_gap_percent"] == [pytest.approx(100 * (tail_z / tail_adamw - 1)), pytest.approx(0.0)]
    # the worst ratio is taken at the same rate, seed and step: the spike at 1e-3, seed 1, step 1
    assert best["z"]["worst_ratio_to_adamw_by_lr"][1e-3] == pytest.approx(3.0 / 2.5)
    assert best["z"]["worst_ratio_to_adamw_by_lr"][5e-4] == pytest.approx(1.0)  # the base, step 0
    assert best["adamw"]["best_gap_percent"] == [0.0, 0.0]


def test_a_diverged_rate_is_never_best() -> None:
    records = [*_records(), _record("z", 2e-4, 0, [3.0, 1.0, 1.0, 1.0, 1.0, float("nan")])]
    records.append(_record("z", 2e-4, 1, [3.0, 1.0, 1.0, 1.0, 1.0, 1.0]))
    best = rate_sweep.best_of_rates(records)
    assert best["z"]["best_lr"] == 5e-4
    assert best["z"]["mean_by_lr"][2e-4] == float("inf")


def test_print_best_of_rates_prints_both_tables(capsys: pytest.CaptureFixture[str]) -> None:
    rate_sweep.print_best_of_rates(rate_sweep.best_of_rates(_records()))
    printed = capsys.readouterr().out
    assert "per peak rate" in printed
    assert "Best against best" in printed
    assert "lr 0.0005" in printed
    assert "lr 0.001" in printed
    assert f"last {rate_sweep.TAIL_EVALS} evals" in printed


def test_row_spec_reads_name_and_json_knobs() -> None:
    assert rate_sweep.row_spec('S8={"update_interval": 8, "interim_step": 2.0}') == (
        "S8",
        {"update_interval": 8, "interim_step": 2.0},
    )
    for bad in ("S8", "S8={update_interval: 8}", '=["x"]', 'adamw={"lr": 1}', "S8=[1, 2]"):
        with pytest.raises(ValueError, match="NAME=JSON"):
            rate_sweep.row_spec(bad)
