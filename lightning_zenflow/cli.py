"""The ``lightning-zenflow`` console script: a LightningCLI that knows the ZenFlow strategy.

    lightning-zenflow fit --config configs/main.yaml
    lightning-zenflow fit --config configs/main.yaml --trainer.strategy.topk_ratio=0.2
    lightning-zenflow fit --trainer.strategy.help zenflow     # every knob, with its default and meaning
    lightning-zenflow plan --model Qwen/Qwen2.5-7B             # will it fit this machine, with which knobs, how fast

Any LightningModule / LightningDataModule can be named by ``class_path`` in the YAML. Beyond a plain LightningCLI:

- The short name works together with knob overrides. jsonargparse keeps ``strategy: zenflow`` (or
  ``--trainer.strategy=zenflow``) as a plain string, and a string takes no ``--trainer.strategy.<knob>`` on top
  of it, so every ZenFlow name is turned into the ``class_path`` form before parsing.
- A mistake in the configuration (a knob out of range, a value of the wrong type, an unknown option, a setup the
  strategy refuses, bad data ``lightning_zenflow.llm`` finds) is one ``error: ...`` line on stderr and exit status 2,
  before training starts; the knobs are
  checked right after parsing, before anything is built. ``LIGHTNING_ZENFLOW_DEBUG=1`` shows the traceback instead.
- The exit status is 0 after a successful run, and a failing run keeps its traceback (exit status 1).
"""

from __future__ import annotations

import copy
import json
import os
import re
import sys
import textwrap
from argparse import ArgumentError
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace
from lightning.pytorch.cli import ArgsType, LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.llm.data import DataError
from lightning_zenflow.strategies.base import ZenFlowStrategyBase
from lightning_zenflow.strategies.single import ZenFlowStrategy

PROG = "lightning-zenflow"
DEBUG_ENV = "LIGHTNING_ZENFLOW_DEBUG"
"""Set to ``1`` to get the traceback of a configuration error instead of the one-line message."""

STRATEGY_CLASS_PATH = "lightning_zenflow.ZenFlowStrategy"
STRATEGY_NAMES = frozenset(
    {
        ZenFlowStrategy.strategy_name,
        ZenFlowStrategy.__name__,
        STRATEGY_CLASS_PATH,
        f"{ZenFlowStrategy.__module__}.{ZenFlowStrategy.__name__}",
    }
)
"""Every spelling of the strategy as a plain string; each is rewritten to the ``class_path`` form."""

KNOBS_HELP = f"{PROG} fit --trainer.strategy.help zenflow"
PLAN_COMMAND = "plan"
"""``lightning-zenflow plan --model M``: will a model fit this machine, with which knobs, and how fast."""
_STRATEGY_AS_CLASS = json.dumps({"class_path": STRATEGY_CLASS_PATH})
_CONFIG_OPTIONS = ("-c", "--config")
_STRATEGY_OPTION = "--trainer.strategy"
_STRATEGY_HELP_OPTION = "--trainer.strategy.help"


class ConfigError(Exception):
    """A mistake in the command line or the configuration files: reported in one line, without a traceback."""

    def __init__(self, message: str, tip: str | None = None) -> None:
        super().__init__(message)
        self.tip = tip


class ZenFlowCLI(LightningCLI):
    """LightningCLI with the ZenFlow strategy's short names and one-line configuration errors (see the module doc).

    Raises :class:`ConfigError` for a configuration mistake; :func:`main` prints it.
    """

    def init_parser(self, **kwargs: Any) -> LightningArgumentParser:
        # parse errors become exceptions, so parse_arguments reports them in one line instead of jsonargparse's
        # full usage text followed by a nested Union report
        kwargs.setdefault("exit_on_error", False)
        # the top of --help (a subcommand's comes from its Trainer method's docstring)
        description = kwargs.get("description") or "Lightning Trainer command line tool, with ZenFlow."
        kwargs["description"] = (
            f"{description} Every ZenFlow knob: {KNOBS_HELP}. Will a model fit, with which knobs: "
            f"{PROG} {PLAN_COMMAND} --help"
        )
        return super().init_parser(**kwargs)

    def parse_arguments(self, parser: LightningArgumentParser, args: ArgsType) -> None:
        try:
            if isinstance(args, (dict, Namespace)):
                self.config = parser.parse_object(expand_strategy_name_in_config(args))
            else:
                self.config = parser.parse_args(expand_strategy_name(sys.argv[1:] if args is None else list(args)))
        except ArgumentError as error:
            message = short_error_message(str(error))
            tip = f"{KNOBS_HELP} lists every knob" if "trainer.strategy" in message else f"see {PROG} fit --help"
            raise ConfigError(message, tip) from error
        subcommand = self.config.get("subcommand")
        check_strategy_knobs((self.config[subcommand] if subcommand else self.config).get("trainer.strategy"))

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, MisconfigurationException) as error:
            # every class built here comes from the configuration: its __init__ refusing a value is a config error
            raise ConfigError(short_error_message(str(error))) from error


def main(args: list[str] | None = None) -> int:
    """Run the CLI and return the exit status; ``args`` replaces ``sys.argv[1:]`` (used by tests). ``plan`` is the
    planner's own command line (``lightning_zenflow/planner/cli.py``), without LightningCLI."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == [PLAN_COMMAND]:
        from lightning_zenflow.planner.cli import main as plan_main

        return plan_main(argv[1:])
    try:
        ZenFlowCLI(subclass_mode_model=True, subclass_mode_data=True, save_config_kwargs={"overwrite": True}, args=args)
    except (ConfigError, ArgumentError, MisconfigurationException, DataError) as error:
        # ArgumentError: a parse after parse_arguments, of a checkpoint's hyperparameters (ckpt_path);
        # MisconfigurationException: Lightning's and ZenFlowStrategy's refusals of a setup, before training starts;
        # DataError: bad training data, found by the datamodule's setup before training starts
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        message = short_error_message(str(error)) if isinstance(error, ArgumentError) else str(error)
        print(f"error: {message}", file=sys.stderr)
        tip = getattr(error, "tip", None)
        print(f"tip: {tip + '; ' if tip else ''}{DEBUG_ENV}=1 shows the traceback", file=sys.stderr)
        return 2
    return 0


def expand_strategy_name(args: list[str]) -> list[str]:
    """Command-line arguments with every ZenFlow strategy name in the ``class_path`` form jsonargparse can extend.

    ``--trainer.strategy=zenflow`` becomes ``--trainer.strategy={"class_path": "lightning_zenflow.ZenFlowStrategy"}``,
    and so does a config file whose ``trainer.strategy`` is such a name: the class form is inserted right after the
    ``--config`` option, where the file's own value would have been set, so later options still override it.
    """
    expanded: list[str] = []
    index = 0
    while index < len(args):
        arg = args[index]
        option, has_inline_value, inline_value = arg.partition("=")
        takes_value = option in (*_CONFIG_OPTIONS, _STRATEGY_OPTION, _STRATEGY_HELP_OPTION)
        if not takes_value or (not has_inline_value and index + 1 >= len(args)):
            expanded.append(arg)
            index += 1
            continue
        value = inline_value if has_inline_value else args[index + 1]
        index += 1 if has_inline_value else 2
        if option == _STRATEGY_OPTION and value in STRATEGY_NAMES:
            value = _STRATEGY_AS_CLASS
        elif option == _STRATEGY_HELP_OPTION and value in STRATEGY_NAMES:
            value = STRATEGY_CLASS_PATH
        expanded.extend([f"{option}={value}"] if has_inline_value else [option, value])
        if option in _CONFIG_OPTIONS and _names_the_strategy(_strategy_in(_load_config(value))):
            expanded.append(f"{_STRATEGY_OPTION}={_STRATEGY_AS_CLASS}")
    return expanded


def expand_strategy_name_in_config(config: dict | Namespace) -> dict:
    """A copy of a structured config (``LightningCLI(args={...})``), the strategy name in the ``class_path`` form."""
    config = config.as_dict() if isinstance(config, Namespace) else copy.deepcopy(config)
    for level in (config, *config.values()):  # the top level, or one level down under a subcommand
        trainer = level.get("trainer") if isinstance(level, dict) else None
        if isinstance(trainer, dict) and _names_the_strategy(trainer.get("strategy")):
            trainer["strategy"] = {"class_path": STRATEGY_CLASS_PATH}
    return config


def check_strategy_knobs(strategy: Any) -> None:
    """Validate the ZenFlow knobs of a parsed ``trainer.strategy`` before any class is built.

    jsonargparse checks the types; :class:`ZenFlowConfig` checks the values, and its message names the knob and the
    fix. Building the strategy later would raise the same error, but buried in jsonargparse's report.
    """
    if not isinstance(strategy, Namespace) or not isinstance(strategy.get("class_path"), str):
        return
    module_name, _, class_name = strategy.class_path.rpartition(".")
    strategy_class = getattr(sys.modules.get(module_name), class_name, None)  # jsonargparse imported it to parse
    if not (isinstance(strategy_class, type) and issubclass(strategy_class, ZenFlowStrategyBase)):
        return
    init_args = strategy.get("init_args") or Namespace()
    knobs = {field.name: init_args[field.name] for field in fields(ZenFlowConfig) if field.name in init_args}
    try:
        ZenFlowConfig(**knobs)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"trainer.strategy: {error}", f"{KNOBS_HELP} lists every knob") from error


def short_error_message(message: str) -> str:
    """jsonargparse's report of a bad value, reduced to its innermost problem with the full key.

    A value inside a class inside a ``Union`` (``trainer.strategy`` is ``str | Strategy``) is reported as a nested
    list of every alternative that failed, then a dump of the whole value; what the user needs is one line:
    ``trainer.strategy.select_strategy: expected one of 'auto', 'step', 'epoch', got foo``.
    """
    keys, detail = _innermost_problem(message)
    detail = re.sub(r"<class '([\w.]+)'>", r"\1", detail)
    detail = re.sub(r"typing\.Literal\[(.*?)\]", r"one of \1", detail)
    detail = re.sub(r"^Expected a (.*)\. Got value: (.*)$", r"expected \1, got \2", detail)
    return f"{'.'.join(keys)}: {detail}" if keys else detail


def _innermost_problem(text: str) -> tuple[list[str], str]:
    text = textwrap.dedent(text).strip()
    if match := re.match(r'Parser key "([^"]+)":\n(.*)', text, flags=re.S):
        keys, detail = _innermost_problem(match.group(2))
        return [match.group(1), *keys], detail
    if match := re.match(r"Problem with given class_path '[^']*':\n(.*)", text, flags=re.S):
        return _innermost_problem(match.group(1))
    if match := re.search(r"^Errors:\n(.*?)\n\S", text, flags=re.S | re.M):
        # a Union: drop the alternatives that only say "not a string" / "not None"; keep the one that explains
        alternatives = re.split(r"^- ", textwrap.dedent(match.group(1)), flags=re.M)
        alternatives = [a.strip() for a in alternatives if a.strip()]
        explaining = [a for a in alternatives if not re.fullmatch(r"Expected a <class '(str|NoneType)'>", a)]
        if len(explaining) == 1:
            return _innermost_problem(explaining[0])
    lines = [line for line in text.splitlines() if not line.startswith(("Given value", "Subtypes:"))]
    return [], " ".join(" ".join(lines).split())


def _load_config(value: str) -> Any:
    """The content of a ``--config`` value: a file, or YAML given inline; ``None`` when unreadable (jsonargparse
    reports that itself)."""
    try:
        text = Path(value).read_text() if Path(value).is_file() else value
        return yaml.safe_load(text)
    except (OSError, ValueError, yaml.YAMLError):
        return None


def _strategy_in(config: Any) -> Any:
    trainer = config.get("trainer") if isinstance(config, dict) else None
    return trainer.get("strategy") if isinstance(trainer, dict) else None


def _names_the_strategy(value: Any) -> bool:
    return isinstance(value, str) and value in STRATEGY_NAMES


if __name__ == "__main__":
    sys.exit(main())
