"""The CLI end to end: the main job, both YAML forms of the strategy, and the examples, in subprocesses."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHORT_RUN = [
    "--trainer.max_steps=6",
    "--trainer.val_check_interval=3",
    "--trainer.limit_val_batches=2",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.n_layer=1",
    "--model.init_args.n_embd=32",
    "--model.init_args.block_size=32",
    "--data.init_args.block_size=32",
    "--data.init_args.batch_size=4",
    "--data.init_args.max_bytes=200000",
]


def _run(args: list[str], tmp_path: Path, timeout: int = 240) -> str:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    return output


def test_main_job_for_a_few_steps(tmp_path: Path) -> None:
    """The README's main command (lightning-zenflow fit --config configs/main.yaml), shortened."""
    config = ROOT / "configs" / "main.yaml"
    cli = [sys.executable, "-m", "lightning_zenflow.cli", "fit", "--config", str(config)]
    output = _run([*cli, *SHORT_RUN, f"--trainer.default_root_dir={tmp_path}"], tmp_path)
    assert "ZenFlow run summary: 6 optimizer steps" in output
    assert "stall share" in output


def test_class_path_form_works_with_a_plain_lightning_cli(tmp_path: Path) -> None:
    """`class_path: lightning_zenflow.ZenFlowStrategy` needs no import of the package by the script."""
    script = tmp_path / "plain_cli.py"
    script.write_text(
        "from lightning.pytorch.cli import LightningCLI\n\n"
        "if __name__ == '__main__':\n"
        "    cli = LightningCLI(subclass_mode_model=True, subclass_mode_data=True)\n"
        "    print('STRATEGY', type(cli.trainer.strategy).__name__, cli.trainer.strategy.zenflow_config.topk_ratio)\n"
    )
    config = ROOT / "configs" / "zenflow_knobs.yaml"
    output = _run(
        [
            sys.executable,
            str(script),
            "fit",
            "--config",
            str(config),
            *SHORT_RUN,
            "--trainer.strategy.init_args.topk_ratio=0.25",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        tmp_path,
    )
    assert "STRATEGY ZenFlowStrategy 0.25" in output


def test_engine_loop_example(tmp_path: Path) -> None:
    output = _run([sys.executable, str(ROOT / "examples" / "engine_loop.py"), "--steps", "6"], tmp_path)
    assert "6 steps in" in output


def test_train_example(tmp_path: Path) -> None:
    output = _run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_zenflow.py"),
            "--max-steps",
            "4",
            "--data",
            str(ROOT / "README.md"),
        ],
        tmp_path,
    )
    assert "ZenFlow run summary: 4 optimizer steps" in output


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the transformers extra")
def test_hugging_face_example(tmp_path: Path) -> None:
    output = _run([sys.executable, str(ROOT / "examples" / "finetune_hf.py"), "--max-steps", "3"], tmp_path)
    assert "ZenFlow run summary: 3 optimizer steps" in output
