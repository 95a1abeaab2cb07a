"""The repository's promises: README commands, CI script, knob table, strategy signature, shipped configs."""

from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path

import pytest

from lightning_zenflow import ZenFlowConfig
from lightning_zenflow.config import knob_table

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
KNOBS_DOC = (ROOT / "docs" / "knobs.md").read_text()


def _bash_blocks(text: str) -> list[str]:
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_exactly_the_readme_test_command() -> None:
    test_command = next(b for b in _bash_blocks(README) if "pytest" in b)
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert test_command in ci_lines, f"README test command {test_command!r} is not a line of .ci/run"


def test_the_readmes_plan_command_prints_what_the_readme_shows(capsys: pytest.CaptureFixture) -> None:
    """The README's planner command, run as it is: it exits 0 and its recommendation is the line the README quotes."""
    from lightning_zenflow.planner.cli import main

    command = next(b for b in _bash_blocks(README) if b.startswith("lightning-zenflow plan"))
    args = [str(ROOT / arg) if arg.startswith("configs/") else arg for arg in command.split()[2:]]
    assert main(args) == 0
    recommended = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("recommended: "))
    assert recommended in README, f"the README quotes another recommendation than the planner's: {recommended}"


def test_readme_main_job_command_uses_the_main_config() -> None:
    main_command = next(b for b in _bash_blocks(README) if "lightning-zenflow fit" in b)
    assert main_command.startswith('python -m pip install "torch==2.13.0" -e . && ')
    config = main_command.split("--config", 1)[1].split()[0]
    assert (ROOT / config).is_file()


def test_docs_knob_table_is_generated_from_the_config() -> None:
    assert "docs/knobs.md" in README, "the README no longer links the full knob table"
    table = KNOBS_DOC.split("<!-- knob-table -->", 1)[1].split("<!-- /knob-table -->", 1)[0].strip()
    assert table == knob_table(), (
        "docs/knobs.md knob table is stale: paste the output of python -m lightning_zenflow.config"
    )


def test_every_knob_has_a_documented_row() -> None:
    table = knob_table()
    for field in ZenFlowConfig.__dataclass_fields__:
        assert f"| `{field}` |" in table


@pytest.mark.parametrize(
    "owner", ["ZenFlowStrategy", "ZenFlowDDPStrategy", "ZenFlowFSDPStrategy", "ZenFlowAdamW"], ids=str
)
def test_every_signature_mirrors_the_config(owner: str) -> None:
    """The knobs of the four typed signatures (DESIGN section 2: keyword arguments, no ``**kwargs``) are the config's
    fields, in order, with its defaults and its types: the config is the single source, the signatures its mirrors
    (``ZenFlowAdamW`` leaves out the Trainer's own knobs)."""
    import lightning_zenflow
    from lightning_zenflow.optim import LIGHTNING_ONLY_KNOBS

    cls = getattr(lightning_zenflow, owner)
    parameters = inspect.signature(cls.__init__).parameters
    knobs = [
        name
        for name in ZenFlowConfig.__dataclass_fields__
        if owner != "ZenFlowAdamW" or name not in LIGHTNING_ONLY_KNOBS
    ]
    names = list(parameters)
    start = names.index(knobs[0])
    assert names[start : start + len(knobs)] == knobs
    defaults = ZenFlowConfig()
    fields = ZenFlowConfig.__dataclass_fields__
    for name in knobs:
        default = parameters[name].default
        # the one documented exception (the config's docstring says it): FSDP2 never gathers a checkpoint by default
        fsdp_checkpoints = (owner, name) == ("ZenFlowFSDPStrategy", "checkpoint_format")
        expected = "sharded" if fsdp_checkpoints else getattr(defaults, name)
        assert (tuple(default) if isinstance(default, list) else default) == expected, name
        if name != "sync_on":  # the strategies also take a list
            assert parameters[name].annotation == fields[name].type, name
    if owner != "ZenFlowAdamW":  # its docstring names the config's table instead
        documented = cls.__doc__ or ""
        for name in knobs:
            assert f"{name}:" in documented, f"{owner} docstring misses {name}"


def test_readme_links_the_update_rule() -> None:
    assert "docs/update_rule.md" in README
    assert (ROOT / "docs" / "update_rule.md").is_file()


@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_parses_through_the_cli(
    config: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning_zenflow.cli import main

    monkeypatch.setattr(sys, "argv", ["lightning-zenflow"])
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "strategy:" in printed
    assert re.search(r"class_path: lightning_zenflow\.(demo|llm)\.", printed)


# ------------------------------------------------------------------------------------------------ benchmarks
BENCHMARKS = ROOT / "benchmarks"
BENCHMARK_HELPERS = {"bench_utils", "offload_report", "domains", "rate_sweep"}
"""The scripts in benchmarks/ that are imported by the others, not run: each other script answers one question."""


def _benchmark_scripts() -> set[str]:
    return {path.stem for path in BENCHMARKS.glob("*.py")} - BENCHMARK_HELPERS


def _lines(paths) -> int:
    return sum(len(path.read_text().splitlines()) for path in paths if path.is_file())


def test_the_benchmarks_are_at_most_a_fifth_of_the_house() -> None:
    """The benchmark scripts' lines against the package's, the benchmarks' and the scripts' (docs/development.md)."""
    benchmarks = _lines(BENCHMARKS.glob("*.py"))
    house = benchmarks + _lines((ROOT / "lightning_zenflow").rglob("*.py")) + _lines((ROOT / "scripts").glob("*"))
    assert benchmarks <= house / 5, f"benchmarks/*.py: {benchmarks} lines of {house} ({benchmarks / house:.1%})"


def test_the_benchmark_tables_list_exactly_the_scripts_that_exist() -> None:
    table = (BENCHMARKS / "README.md").read_text().split("\n\n| script |", 1)[1].split("\n\n", 1)[0]
    assert set(re.findall(r"^\| `(\w+)\.py`", table, flags=re.M)) == _benchmark_scripts()
    docs_commands = re.findall(r"^python benchmarks/(\w+)\.py", (ROOT / "docs" / "benchmarks.md").read_text(), re.M)
    assert set(docs_commands) == _benchmark_scripts()


@pytest.mark.parametrize(
    "doc",
    ["README.md", "benchmarks/README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
    + [f"scripts/{p.name}" for p in (ROOT / "scripts").glob("*.sh")],
)
def test_every_benchmark_command_names_a_script_and_flags_that_exist(doc: str) -> None:
    """``python benchmarks/x.py --flag`` in the docs and the shell scripts: x exists and declares --flag (itself or
    through bench_utils' common flags). RESULTS.md is left out: it keeps the commands of retired scripts, each with the
    commit to check out first."""
    text = (ROOT / doc).read_text().replace("\\\n", " ")
    prefix = r"benchmarks/" if doc.endswith(".sh") else r"python benchmarks/"
    common = (BENCHMARKS / "bench_utils.py").read_text()
    for name, arguments in re.findall(prefix + r"(\w+)\.py([^`\n#;|]*)", text):
        script = BENCHMARKS / f"{name}.py"
        assert script.is_file(), f"{doc} runs benchmarks/{name}.py, which does not exist"
        declared = set(re.findall(r'"(--[a-z][a-z0-9-]*)"', script.read_text() + common))
        for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", arguments):
            assert flag in declared, f"{doc}: benchmarks/{name}.py has no {flag}"
