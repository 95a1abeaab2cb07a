"""Train the demo GPT on the embedded corpus with ZenFlow, from Python (the main job without the CLI).

python examples/train_zenflow.py                      # about two minutes on 2 CPU cores
python examples/train_zenflow.py --max-steps 50 --data my_texts/
"""

from __future__ import annotations

import argparse

import lightning as L

import lightning_zenflow  # noqa: F401  (registers strategy="zenflow")
from lightning_zenflow.demo import ByteCorpusDataModule, CausalLMModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-steps", type=int, default=600)
    parser.add_argument("--data", default=None, help="a text file or folder (default: the Python stdlib source)")
    parser.add_argument("--topk-ratio", type=float, default=0.1)
    parser.add_argument("--update-interval", default="4", help="an int or 'auto'")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    L.seed_everything(0)
    model = CausalLMModule(learning_rate=2e-3, warmup_steps=50, lr_schedule="cosine")
    data = ByteCorpusDataModule(data_path=args.data)
    interval = args.update_interval if args.update_interval == "auto" else int(args.update_interval)
    trainer = L.Trainer(
        strategy=lightning_zenflow.ZenFlowStrategy(topk_ratio=args.topk_ratio, update_interval=interval),
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=min(200, args.max_steps),
        limit_val_batches=20,
        default_root_dir="runs/example",
    )
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
