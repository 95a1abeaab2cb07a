"""The engine under CUDA's stream sanitizer: a few steps of each setting whose device work crosses streams, with the
streams delayed at random, and any access of one stream to memory another stream wrote or freed without an order
between them reported as an error.

``TORCH_CUDA_SANITIZER=1`` makes torch's CUDA sanitizer (``torch.cuda._sanitizer``) watch every aten kernel launch
with the tensors it reads and writes, on which stream, and the events and waits between streams; a read on the side
stream of a tensor the compute stream wrote after the side stream's last wait on it raises ``CUDASanitizerErrors``.
Compiled kernels (Triton) are not aten launches, so the engine settings here run the eager kernels, which the
sanitizer sees op by op; the Lightning fits run as a user's would. ``LIGHTNING_ZENFLOW_LANES=adversarial`` queues a
random sleep on each stream before each piece of work, so a missing wait also changes what runs first.

Settings, each a few optimizer steps with a warm-up step, the first selection and a refresh, host updates landing:

1. the engine, bf16 weights (what ``precision="bf16-true"`` trains), the compact state, interim moves, device
   accumulation;
2. the engine, fp32 weights with a loss scaler's overflow flag at every step and an overflow at step 5 (what
   ``precision="16-mixed"`` does), host accumulation;
3. a Lightning fit with ``precision="bf16-true"``;
4. a Lightning fit with ``precision="16-mixed"``.

    TORCH_CUDA_SANITIZER=1 python scripts/gpu_sanitize.py      # on a GPU (scripts/gpu_checks.sh runs it so)
    python scripts/gpu_sanitize.py --device cpu                 # the same runs on the CPU's strict lanes

On the CPU there is no sanitizer; the lanes run strict (``engine/lane.py``: only what CUDA's allocator would keep
survives, a tensor made after a lane's last wait is refused), which is the CPU's stand-in for it. Exit status 0 when
every setting ran clean, 1 otherwise; one line per setting.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable

import lightning
import torch
from torch import nn

import lightning_zenflow
from lightning_zenflow.config import ZenFlowConfig
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.lanes import LANES_ENV, STRICT_ENV

STEPS = 8
OVERFLOW_STEP = 5
KNOBS = {"full_warm_up_rounds": 1, "topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step"}


def _net(dtype: torch.dtype, device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 16)).to(dtype).to(device)


def engine_run(device: str, dtype: torch.dtype, accumulate_on: str, overflow: bool) -> str:
    model = _net(dtype, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = ZenFlowConfig(**KNOBS, select_interval=3, accumulate_on=accumulate_on, interim_kernel="eager")
    generator = torch.Generator().manual_seed(1)
    with ZenFlowEngine(optimizer, config) as engine:
        for t in range(1, STEPS + 1):
            engine.wait_for_update()
            x = torch.randn(16, 32, generator=generator).to(device=device, dtype=dtype)
            loss = model(x).float().square().mean()
            loss.backward()
            found_inf = None
            if overflow:
                # as a loss scaler makes it: a fresh device flag each step, dropped by the caller after the step
                found_inf = torch.tensor(1.0 if t == OVERFLOW_STEP else 0.0, device=device)
            engine.step(found_inf=found_inf)
            optimizer.zero_grad(set_to_none=True)
        engine.flush()
        engine.wait_for_update()
    if device == "cuda":
        torch.cuda.synchronize()  # every stream's work is done before the weights are read
    moved = all(torch.isfinite(p).all() for p in model.parameters())
    return "trained, weights finite" if moved else "non-finite weights"


class _Module(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).float(), y.float())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        generator = torch.Generator().manual_seed(2)
        data = torch.utils.data.TensorDataset(torch.randn(64, 32, generator=generator), torch.randn(64, 16))
        return torch.utils.data.DataLoader(data, batch_size=8)


def lightning_run(device: str, precision: str) -> str:
    strategy = lightning_zenflow.ZenFlowStrategy(**KNOBS, select_interval=3)
    trainer = lightning.Trainer(
        strategy=strategy,
        accelerator=device,
        devices=1,
        precision=precision,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = _Module()
    trainer.fit(module)
    return f"{trainer.global_step} steps"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    os.environ[LANES_ENV] = "adversarial"
    if args.device == "cuda":
        if os.environ.get("TORCH_CUDA_SANITIZER") is None:
            print("TORCH_CUDA_SANITIZER is not set: the runs go on without the sanitizer watching", flush=True)
    else:
        os.environ[STRICT_ENV] = "1"
    precision_16 = "16-mixed" if args.device == "cuda" else "bf16-mixed"  # torch's CPU autocast has no fp16 scaler
    settings: dict[str, Callable[[], str]] = {
        "engine, bf16 weights, compact state, interim moves, device accumulation": lambda: engine_run(
            args.device, torch.bfloat16, "device", overflow=False
        ),
        "engine, fp32 weights, an overflow flag every step, host accumulation": lambda: engine_run(
            args.device, torch.float32, "host", overflow=True
        ),
        "Lightning, bf16-true": lambda: lightning_run(args.device, "bf16-true"),
        f"Lightning, {precision_16}": lambda: lightning_run(args.device, precision_16),
    }
    failed = 0
    for name, run in settings.items():
        started = time.perf_counter()
        try:
            outcome = run()
        except Exception as error:  # noqa: BLE001 - every setting runs and says how it ended
            failed += 1
            traceback.print_exc()
            print(f"FAIL {name}: {type(error).__name__}: {str(error)[:500]}", flush=True)
            continue
        print(f"ok   {name}: {outcome} ({time.perf_counter() - started:.1f} s)", flush=True)
    print(f"{len(settings) - failed} of {len(settings)} settings ran clean on {args.device}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
