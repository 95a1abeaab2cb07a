"""The CLI end to end: the README's commands in subprocesses (exit status checked), both YAML forms of the strategy,
knob overrides, one-line errors for bad knobs, the strategy's --help, and the examples (run in this process as
``python examples/<name>`` runs them)."""

from __future__ import annotations

import importlib.util
import inspect
import logging
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_zenflow import ZenFlowConfig, ZenFlowStrategy
from lightning_zenflow.cli import (
    DEBUG_ENV,
    STRATEGY_CLASS_PATH,
    ConfigError,
    expand_strategy_name,
    expand_strategy_name_in_config,
    main,
)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
MAIN_CONFIG = ROOT / "configs" / "main.yaml"
KNOBS_CONFIG = ROOT / "configs" / "zenflow_knobs.yaml"
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
    "--model.init_args.pretrain_steps=4",
    "--model.init_args.pretrain_batch_size=2",
    "--model.init_args.pretrain_max_bytes=100000",
]
"""The README's commands, shortened: a tiny model, a tiny base (pre-trained in the run's folder), a few steps."""


def _run(args: list[str], tmp_path: Path, timeout: int = 240, expect: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop(DEBUG_ENV, None)
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    assert result.returncode == expect, (result.stdout + result.stderr)[-4000:]
    return result


def _readme_command(command: str, doc: str = "README.md") -> list[str]:
    """``command`` as the README (or the docs page ``doc``) shows it, ready to run from any folder (it must stay
    there)."""
    text = README if doc == "README.md" else (ROOT / doc).read_text()
    assert command in text, f"{doc} no longer shows `{command}`; keep it and this test in step"
    next_to_python = str(Path(sys.executable).parent)
    script = shutil.which("lightning-zenflow", path=next_to_python) or shutil.which("lightning-zenflow")
    if script is None:
        pytest.skip("the lightning-zenflow console script is not installed (python -m pip install -e .)")
    args = shlex.split(command)
    return [script, *(str(ROOT / arg) if arg.startswith("configs/") else arg for arg in args[1:])]


def _printed_config(args: list[str], capsys: pytest.CaptureFixture) -> dict:
    """The config `lightning-zenflow fit <args> --print_config` prints (in process: it parses and exits)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def _error_of(args: list[str], capsys: pytest.CaptureFixture) -> str:
    """The stderr of `lightning-zenflow fit <args>`, which must fail with exit status 2 and no traceback."""
    assert main(["fit", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    error_lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(error_lines) == 1, err
    return error_lines[0]


def _config_error(**knobs: object) -> Exception:
    """The exception ZenFlowConfig raises for these knobs: the CLI must print its message as it is."""
    with pytest.raises((ValueError, TypeError)) as error:
        ZenFlowConfig(**knobs)  # type: ignore[arg-type]
    return error.value


def _shown(default: object) -> str:
    """A default as jsonargparse's help prints it."""
    return "null" if default is None else str(default)


# ------------------------------------------------------------------------------- the README's commands, as a user


def test_main_job_for_a_few_steps(tmp_path: Path) -> None:
    """The README's main command, shortened: it pre-trains a base and caches it, fine-tunes, prints its summary with
    the AdamW reference and nothing after it, and exits 0."""
    command = _readme_command("lightning-zenflow fit --config configs/main.yaml")
    result = _run([*command, *SHORT_RUN, f"--trainer.default_root_dir={tmp_path}"], tmp_path)
    last_line = result.stderr.strip().splitlines()[-1]  # Lightning's log, and Python's sys.exit(<object>), use stderr
    assert last_line.startswith("ZenFlow run summary: 6 optimizer steps"), result.stderr[-2000:]
    reference = f"(AdamW reference for this job: {_readme_reference():.4f}, "
    assert re.search(r"final val_loss \d\.\d{4} " + re.escape(reference) + r"[+-]\d+\.\d %, see README\)", last_line)
    assert "stall share" in last_line
    assert "LightningCLI object" not in result.stdout + result.stderr
    assert "base: pre-training" in result.stderr
    # the config's cache folder, relative to the working directory; tests/test_demo_base.py covers its reuse
    assert len(list((tmp_path / "runs" / "base_cache").glob("base-*.pt"))) == 1


def _readme_reference() -> float:
    """The AdamW reference loss the README quotes for the main job."""
    match = re.search(r"AdamW reference for this job: (\d\.\d{4})", README)
    assert match, "the README no longer quotes the main job's AdamW reference"
    return float(match.group(1))


@pytest.mark.parametrize(
    "config", ["main.yaml", "baseline_adamw.yaml", "baseline_sync_offload.yaml", "zenflow_knobs.yaml"]
)
def test_the_fine_tune_configs_quote_the_readme_reference(config: str) -> None:
    """The reference is measured with baseline_adamw.yaml; every config of that job quotes the same number."""
    trainer = yaml.safe_load((ROOT / "configs" / config).read_text())["trainer"]
    (telemetry,) = [c for c in trainer["callbacks"] if c["class_path"] == "lightning_zenflow.ZenFlowTelemetry"]
    assert telemetry["init_args"]["reference_loss"] == _readme_reference()
    assert telemetry["init_args"]["loss_key"] == "val_loss"


def test_a_missing_base_checkpoint_is_one_line_and_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "base.ckpt"
    error = _error_of(["--config", str(MAIN_CONFIG), f"--model.base_checkpoint={missing}"], capsys)
    assert error.startswith(f"error: model.base_checkpoint='{missing}' does not exist. Pass model.base_checkpoint")
    error = _error_of(["--config", str(MAIN_CONFIG), f"--model.pretrain_data_path={missing}"], capsys)
    assert f"pretrain_data_path='{missing}' does not exist" in error


def test_a_knob_override_on_the_short_form(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`strategy: zenflow` in the YAML and `--trainer.strategy.topk_ratio=0.2` on the command line (the README's), run
    in this process (the main job's test above runs the console script itself)."""
    command = _readme_command("lightning-zenflow fit --config configs/main.yaml --trainer.strategy.topk_ratio=0.2")
    monkeypatch.chdir(tmp_path)  # the config's relative folders (the base cache) land in the run's folder
    assert main([*command[1:], *SHORT_RUN, f"--trainer.default_root_dir={tmp_path}"]) == 0
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())  # what the run was built from
    assert saved["trainer"]["strategy"]["class_path"] == STRATEGY_CLASS_PATH
    assert saved["trainer"]["strategy"]["init_args"]["topk_ratio"] == 0.2


def test_a_bad_knob_is_one_line_and_exit_status_2(tmp_path: Path) -> None:
    command = _readme_command(
        "lightning-zenflow fit --config configs/main.yaml --trainer.strategy.topk_ratio=2", doc="docs/usage.md"
    )
    result = _run(command, tmp_path, expect=2)
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [
        "error: trainer.strategy: " + str(_config_error(topk_ratio=2.0))
    ]
    assert "--trainer.strategy.help zenflow" in result.stderr
    assert "topk_ratio=0.1" in result.stderr, "the message names the fix"


def test_strategy_help_lists_every_knob_with_default_and_meaning(capsys: pytest.CaptureFixture) -> None:
    assert "lightning-zenflow fit --trainer.strategy.help zenflow" in README
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.strategy.help", "zenflow"])
    assert exit_info.value.code in (0, None)
    help_text = capsys.readouterr().out
    # cleandoc: Python 3.13 strips a docstring's indentation when compiling, earlier versions keep it
    meanings = dict(re.findall(r"^ {4}(\w+): (.+)$", inspect.cleandoc(ZenFlowStrategy.__doc__ or ""), flags=re.M))
    for knob in (field.name for field in ZenFlowConfig.__dataclass_fields__.values()):
        # the option's entry (indented by two spaces; the usage lines above list it too) up to the next one
        block = help_text.split(f"\n  --trainer.strategy.{knob} ", 1)[1].split("\n  --", 1)[0]
        block = " ".join(block.split())
        assert f"default: {_shown(getattr(ZenFlowConfig(), knob))}" in block, knob
        first_words = " ".join(meanings[knob].split()[:4])
        assert first_words in block, f"{knob}: the help misses its meaning {first_words!r}"


# ------------------------------------------------------------------------------- the strategy's spellings


@pytest.mark.parametrize(
    ("args", "topk_ratio", "update_interval"),
    [
        (["--config", str(MAIN_CONFIG)], 0.1, 4),
        (["--config", str(MAIN_CONFIG), "--trainer.strategy.topk_ratio=0.2"], 0.2, 4),
        (["--config", str(MAIN_CONFIG), "--trainer.strategy.init_args.update_interval=8"], 0.1, 8),
        (["-c", str(MAIN_CONFIG), "--trainer.strategy", "zenflow", "--trainer.strategy.topk_ratio", "0.05"], 0.05, 4),
        (["--config", str(KNOBS_CONFIG), "--trainer.strategy.topk_ratio=0.3"], 0.3, 4),
        (
            ["-c", str(KNOBS_CONFIG), "--trainer.strategy=zenflow", "--trainer.strategy.update_interval=auto"],
            0.1,
            "auto",
        ),
        (["--config", str(MAIN_CONFIG), f"--trainer.strategy={STRATEGY_CLASS_PATH}"], 0.1, 4),
    ],
    ids=["yaml", "yaml+knob", "yaml+init_args", "-c+name+knob", "class_path+knob", "name+knob", "class-path-alone"],
)
def test_every_spelling_takes_knob_overrides(
    args: list[str], topk_ratio: float, update_interval: object, capsys: pytest.CaptureFixture
) -> None:
    strategy = _printed_config(args, capsys)["trainer"]["strategy"]
    assert strategy["class_path"] == STRATEGY_CLASS_PATH
    assert strategy["init_args"]["topk_ratio"] == topk_ratio
    assert strategy["init_args"]["update_interval"] == update_interval


def test_later_options_still_override_the_short_form(capsys: pytest.CaptureFixture) -> None:
    """The class form stands where the YAML set the name: a later config or option replaces the strategy."""
    baseline = ROOT / "configs" / "baseline_adamw.yaml"
    then_baseline = _printed_config(["--config", str(MAIN_CONFIG), "--config", str(baseline)], capsys)
    assert then_baseline["trainer"]["strategy"] == "auto"
    then_ddp = _printed_config(["--config", str(MAIN_CONFIG), "--trainer.strategy=ddp"], capsys)
    assert then_ddp["trainer"]["strategy"] == "ddp"


def test_the_name_is_expanded_only_where_the_strategy_is_given() -> None:
    class_form = '{"class_path": "lightning_zenflow.ZenFlowStrategy"}'
    assert expand_strategy_name(["fit", "--trainer.strategy=zenflow"]) == ["fit", f"--trainer.strategy={class_form}"]
    assert expand_strategy_name(["fit", "--trainer.strategy", "ddp"]) == ["fit", "--trainer.strategy", "ddp"]
    assert expand_strategy_name(["fit", "--model.name=zenflow", "--trainer.strategy"]) == [
        "fit",
        "--model.name=zenflow",
        "--trainer.strategy",
    ]
    inline = "trainer: {strategy: zenflow}"
    assert expand_strategy_name(["--config", inline]) == ["--config", inline, f"--trainer.strategy={class_form}"]
    structured = {"fit": {"trainer": {"strategy": "zenflow"}}, "subcommand": "fit"}
    expanded = expand_strategy_name_in_config(structured)
    assert expanded["fit"]["trainer"]["strategy"] == {"class_path": STRATEGY_CLASS_PATH}
    assert structured["fit"]["trainer"]["strategy"] == "zenflow", "the caller's dict is not changed"


# ------------------------------------------------------------------------------- errors


def test_a_bad_knob_in_the_yaml(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        f"trainer:\n  strategy:\n    class_path: {STRATEGY_CLASS_PATH}\n    init_args:\n      topk_ratio: 1.5\n"
    )
    error = _error_of(["--config", str(MAIN_CONFIG), "--config", str(bad)], capsys)
    assert error == f"error: trainer.strategy: {_config_error(topk_ratio=1.5)}"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--trainer.strategy.select_interval=3", "select_interval=3"),  # a value ZenFlowConfig refuses
        ("--trainer.strategy.sync_on=[validation,nope]", "sync_on has unknown boundaries ['nope']"),
        ("--trainer.strategy.select_strategy=often", "trainer.strategy.select_strategy: expected one of 'auto'"),
        ("--trainer.strategy.topk_ratio=lots", "trainer.strategy.topk_ratio: expected float, got lots"),
        ("--trainer.strategy.topk=0.2", "trainer.strategy: Option 'topk' is not accepted"),  # a misspelt knob
        # the strategy's up-front refusal, while the Trainer is built: one device named, two asked for
        ("--trainer.strategy.device=cpu --trainer.devices=2", "Leave out `device`"),
    ],
)
def test_bad_values_on_the_command_line(override: str, expected: str, capsys: pytest.CaptureFixture) -> None:
    assert expected in _error_of(["--config", str(MAIN_CONFIG), *override.split()], capsys)


def test_the_debug_variable_shows_the_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1")
    with pytest.raises(ConfigError, match="topk_ratio=2.0 is outside") as error:
        main(["fit", "--config", str(MAIN_CONFIG), "--trainer.strategy.topk_ratio=2"])
    assert isinstance(error.value.__cause__, ValueError)


def test_a_run_that_fails_while_training_keeps_its_traceback(tmp_path: Path) -> None:
    """Not a configuration mistake: the exception leaves main() (the console script then exits with 1)."""
    missing = tmp_path / "no_such_corpus"
    args = ["fit", "--config", str(MAIN_CONFIG), *SHORT_RUN, f"--data.init_args.data_path={missing}"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        main([*args, f"--trainer.default_root_dir={tmp_path}"])


# ------------------------------------------------------------------------------- shipped configs and examples


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_bound_the_epochs(config: Path) -> None:
    """With max_steps alone Lightning sets max_epochs=-1, which the rich progress bar shows as "Epoch 0/-2"."""
    trainer = yaml.safe_load(config.read_text())["trainer"]
    if "max_steps" in trainer:
        assert isinstance(trainer.get("max_epochs"), int), f"{config.name}: set max_epochs next to max_steps"
        assert trainer["max_epochs"] >= 1


def test_the_knobs_config_spells_out_every_knob_at_its_default() -> None:
    knobs = yaml.safe_load(KNOBS_CONFIG.read_text())["trainer"]["strategy"]["init_args"]
    defaults = ZenFlowConfig()
    assert list(knobs) == list(ZenFlowConfig.__dataclass_fields__), "every knob, in the config's order"
    for name, value in knobs.items():
        expected = getattr(defaults, name)
        assert (tuple(value) if isinstance(value, list) else value) == expected, name


def test_class_path_form_works_with_a_plain_lightning_cli(tmp_path: Path) -> None:
    """`class_path: lightning_zenflow.ZenFlowStrategy` needs no import of the package by the script."""
    script = tmp_path / "plain_cli.py"
    script.write_text(
        "from lightning.pytorch.cli import LightningCLI\n\n"
        "if __name__ == '__main__':\n"
        "    cli = LightningCLI(subclass_mode_model=True, subclass_mode_data=True)\n"
        "    print('STRATEGY', type(cli.trainer.strategy).__name__, cli.trainer.strategy.zenflow_config.topk_ratio)\n"
    )
    result = _run(
        [
            sys.executable,
            str(script),
            "fit",
            "--config",
            str(KNOBS_CONFIG),
            *SHORT_RUN,
            "--trainer.strategy.init_args.topk_ratio=0.25",
            f"--trainer.default_root_dir={tmp_path}",
        ],
        tmp_path,
    )
    assert "STRATEGY ZenFlowStrategy 0.25" in result.stdout


def _run_example(name: str, *argv: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, caplog) -> str:
    """``python examples/<name> *argv`` as a user runs it from ``tmp_path``, but in this process (its ``__main__``
    block, its ``sys.argv``): what it printed and logged (Lightning's messages are log records). The process's torch
    threads and random state are restored after."""
    caplog.set_level(logging.INFO)
    script = ROOT / "examples" / name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    try:
        runpy.run_path(str(script), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
    captured = capfd.readouterr()
    return captured.out + captured.err + caplog.text


def test_engine_loop_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, caplog) -> None:
    printed = _run_example(
        "engine_loop.py", "--steps", "6", tmp_path=tmp_path, monkeypatch=monkeypatch, capfd=capfd, caplog=caplog
    )
    assert "6 steps in" in printed


def test_train_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, caplog) -> None:
    argv = ("--max-steps", "4", "--data", str(ROOT / "README.md"))
    printed = _run_example(
        "train_zenflow.py", *argv, tmp_path=tmp_path, monkeypatch=monkeypatch, capfd=capfd, caplog=caplog
    )
    assert "ZenFlow run summary: 4 optimizer steps" in printed


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs the transformers extra")
def test_hugging_face_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd, caplog) -> None:
    printed = _run_example(
        "finetune_hf.py", "--max-steps", "3", tmp_path=tmp_path, monkeypatch=monkeypatch, capfd=capfd, caplog=caplog
    )
    assert "ZenFlow run summary: 3 optimizer steps" in printed
