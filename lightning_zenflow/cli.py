"""The ``lightning-zenflow`` console script: LightningCLI with the ``"zenflow"`` strategy registered.

    lightning-zenflow fit --config configs/main.yaml
    lightning-zenflow fit --config configs/main.yaml --trainer.strategy.topk_ratio=0.2

Any LightningModule / LightningDataModule can be named by ``class_path`` in the YAML.
"""

from __future__ import annotations

from lightning.pytorch.cli import LightningCLI

import lightning_zenflow  # noqa: F401  (registers the "zenflow" strategy name)


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the CLI; ``args`` replaces ``sys.argv[1:]`` (used by tests)."""
    return LightningCLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
