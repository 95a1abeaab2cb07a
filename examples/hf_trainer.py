"""The Hugging Face Trainer with ZenFlowAdamW: a small GPT-2 built from a config (no download), trained, saved and
resumed. Needs `pip install 'lightning-zenflow[transformers]'`.

    python examples/hf_trainer.py                 # 40 steps, a checkpoint every 20, into runs/hf_trainer
    python examples/hf_trainer.py --resume        # continue from the last checkpoint there
"""

from __future__ import annotations

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from lightning_zenflow import ZenFlowAdamW
from lightning_zenflow.integrations.hf import ZenFlowCallback


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences (a stand-in for a tokenised corpus)."""

    def __init__(self, samples: int = 256, length: int = 32, vocab: int = 256) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def build(output_dir: str, max_steps: int, save_steps: int, knobs: dict | None = None) -> Trainer:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=output_dir,
        max_steps=max_steps,
        save_steps=save_steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        warmup_steps=4,
        logging_steps=10,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
        save_only_model=False,
    )
    optimizer = ZenFlowAdamW(model.parameters(), lr=args.learning_rate, weight_decay=0.01, **(knobs or {}))
    return Trainer(
        model=model,
        args=args,
        train_dataset=RandomTokens(),
        optimizers=(optimizer, None),
        callbacks=[ZenFlowCallback()],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--save-steps", type=int, default=20)
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --output-dir")
    args = parser.parse_args()
    trainer = build(args.output_dir, args.max_steps, args.save_steps)
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"trained to step {trainer.state.global_step}, training loss {result.training_loss:.4f}")


if __name__ == "__main__":
    main()
