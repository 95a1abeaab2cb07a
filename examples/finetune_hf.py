"""Fine-tune a Hugging Face causal LM with ZenFlow (needs `pip install 'lightning-zenflow[transformers]'`).

    python examples/finetune_hf.py                         # a small randomly initialised GPT-2, offline
    python examples/finetune_hf.py --model gpt2 --max-steps 100   # weights from the hub or a local folder

The demo data is byte-level (vocabulary 256); with a pretrained model, bring your own tokenised data module.
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
