"""ZenFlow without Lightning: the framework-free engine driving a plain PyTorch training loop.

    python examples/engine_loop.py --steps 40

The engine never calls optimizer.step(): it reads the param groups (lr, betas, eps, weight_decay) at every
step, so a torch LR scheduler works unchanged.
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.demo import GPT, GPTConfig, load_corpus_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    tokens = load_corpus_bytes(None, max_bytes=1_000_000).long()
    model = GPT(GPTConfig(block_size=args.block_size, n_layer=2, n_embd=64, n_head=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    names = {param: name for name, param in model.named_parameters()}
    config = ZenFlowConfig(topk_ratio=0.1, update_interval=4, select_strategy="step", select_interval=20)

    with ZenFlowEngine(optimizer, config, param_names=names) as engine:
        started = time.perf_counter()
        for step in range(args.steps):
            starts = torch.randint(0, tokens.numel() - args.block_size - 1, (args.batch_size,))
            x = torch.stack([tokens[s : s + args.block_size] for s in starts])
            y = torch.stack([tokens[s + 1 : s + args.block_size + 1] for s in starts])
            engine.wait_for_update()  # before the forward reads the weights (a GPU-side wait on CUDA)
            _, loss = model(x, y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            stats = engine.step()
            scheduler.step()
            if step % 10 == 0 or step == args.steps - 1:
                stall_ms = stats.stall_s * 1e3
                print(f"step {step:4d}  loss {loss.item():.3f}  S={stats.update_interval}  stall {stall_ms:.1f} ms")
        engine.flush()  # end of training: every gradient reaches the weights
        print(f"{args.steps} steps in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
