"""The base model a fine-tune starts from: a checkpoint of the user's, or one pre-trained here and cached on disk.

The main job fine-tunes; it needs a trained base, and a fresh checkout has none. So :func:`load_or_pretrain_base`
pre-trains one with plain ``torch.optim.AdamW`` (the standard library's code by default), saves it under a name keyed
by a hash of everything that decides its weights, and every later run with the same settings loads it instead.

The cache file is written to a temporary name and renamed into place, so a run killed while writing leaves no file
under the final name. A file that still does not load, or whose settings or checksum do not match, is reported in one
warning and pre-trained again.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pathlib
import pickle
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_zenflow.demo.data import corpus_fingerprint, load_corpus_bytes
from lightning_zenflow.demo.gpt import GPT, GPTConfig, WarmupSchedule

CACHE_FORMAT = 2
"""Version of the cache file's layout and of the pre-training loop; a change makes every cached base stale."""

CHECKPOINT_HINT = (
    "Pass model.base_checkpoint a Lightning .ckpt of a CausalLMModule run (runs/<job>/lightning_logs/version_*/"
    "checkpoints/*.ckpt) or a file saved with torch.save(gpt.state_dict(), path), or leave it null to pre-train a "
    "base (model.pretrain_steps)."
)


@dataclass(frozen=True)
class PretrainRecipe:
    """Everything besides the model's shape that decides the weights of a pre-trained base."""

    data_path: str | None = None
    """Text file or folder to pre-train on; ``None``: the standard library's code without docstrings."""

    max_bytes: int = 4_000_000
    """Bytes of text read for pre-training."""

    steps: int = 300
    """Optimizer steps."""

    batch_size: int = 16
    """Blocks per step (random offsets, each ``block_size`` bytes long)."""

    learning_rate: float = 2e-3
    """Peak learning rate: linear warm-up over ``min(50, steps // 10)`` steps, then a cosine decay to 10 %."""

    seed: int = 0
    """Seed of the initialisation and of the batch offsets."""

    def __post_init__(self) -> None:
        for name in ("max_bytes", "steps", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"pretrain_{name}={getattr(self, name)} must be at least 1.")
        if not self.learning_rate > 0:
            raise ValueError(f"pretrain_learning_rate={self.learning_rate} must be positive.")
        if self.data_path is not None and not pathlib.Path(self.data_path).expanduser().exists():
            raise ValueError(
                f"pretrain_data_path={self.data_path!r} does not exist. Pass a text file or a folder of text files, "
                "or leave it null to pre-train on the standard library's code."
            )

    @property
    def warmup_steps(self) -> int:
        return min(50, self.steps // 10)


def base_settings(config: GPTConfig, recipe: PretrainRecipe, device: torch.device) -> dict[str, Any]:
    """What the cache key is a hash of: the model's shape, the recipe, the data's fingerprint, the software."""
    return {
        "format": CACHE_FORMAT,
        "model": asdict(config),
        "recipe": asdict(recipe),
        "data": corpus_fingerprint(recipe.data_path, recipe.max_bytes, "code"),
        "device": device.type,  # kernels differ by float rounding between devices (one thread on the CPU)
        "torch": torch.__version__.split("+")[0],
    }


def cache_path(cache_dir: str | os.PathLike, settings: dict[str, Any]) -> pathlib.Path:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    return pathlib.Path(cache_dir) / f"base-{key}.pt"


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes: damage inside tensor data, which ``torch.load``
    does not notice, changes it."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def load_or_pretrain_base(
    config: GPTConfig, recipe: PretrainRecipe, cache_dir: str | os.PathLike, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The state dict of a :class:`GPT` of shape ``config`` pre-trained by ``recipe``: from the cache in
    ``cache_dir`` when a sound entry exists, else pre-trained now (on ``device``, default CPU) and cached."""
    device = device or torch.device("cpu")
    settings = base_settings(config, recipe, device)
    path = cache_path(cache_dir, settings)
    if path.exists():
        state, problem = _read_cache(path, settings)
        if state is not None:
            rank_zero_info(f"base: loaded the pre-trained base from {path}")
            return state
        rank_zero_warn(f"base: the cached base {path} is unusable ({problem}); pre-training it again.")
    state, record = pretrain_base(config, recipe, device)
    _write_cache(path, settings, state, record)
    rank_zero_info(f"base: cached in {path}; runs with the same model and pretrain_* settings reuse it")
    return state


def pretrain_base(
    config: GPTConfig, recipe: PretrainRecipe, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Pre-train a fresh :class:`GPT` with plain AdamW: random windows of the corpus, the demo's two parameter groups
    (weight decay 0.1 on matrices and embeddings), warm-up then cosine. The global RNG is left as it was.

    On the CPU it runs on one thread (restored afterwards): the same weights, bit for bit, whatever the machine's
    core count, and a steady pace on a busy machine, where two threads sharing two loaded cores ran 9 times slower
    than one in our measurement (about 0.2 s per step of 16 x 128 bytes on one idle core).
    """
    saved_threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _pretrain(config, recipe, device)
    finally:
        torch.set_num_threads(saved_threads)


def _pretrain(
    config: GPTConfig, recipe: PretrainRecipe, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tokens = load_corpus_bytes(recipe.data_path, recipe.max_bytes, stdlib_text="code")
    if tokens.numel() < config.block_size + 2:
        raise ValueError(
            f"The pre-training text holds {tokens.numel()} bytes, too few for one block of block_size="
            f"{config.block_size}. Give more text (pretrain_data_path, pretrain_max_bytes) or a smaller block_size."
        )
    with torch.random.fork_rng(devices=[]):  # CPU RNG only: the model is built on the CPU, offsets drawn there
        torch.manual_seed(recipe.seed)
        model = GPT(config)
        starts = torch.randint(0, tokens.numel() - config.block_size - 1, (recipe.steps, recipe.batch_size))
    model.to(device)
    matrices = [param for param in model.parameters() if param.ndim >= 2]
    vectors = [param for param in model.parameters() if param.ndim < 2]
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=recipe.learning_rate, betas=(0.9, 0.95), eps=1e-8)
    schedule = WarmupSchedule(recipe.warmup_steps, "cosine", recipe.steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    offsets = torch.arange(config.block_size + 1)
    rank_zero_info(
        f"base: pre-training a {model.num_parameters() / 1e6:.2f} M-parameter GPT with AdamW for {recipe.steps} steps "
        f"on {tokens.numel() / 1e6:.1f} MB of {recipe.data_path or 'standard-library code'} (once; cached afterwards)"
    )
    started = time.perf_counter()
    recent_losses: list[float] = []
    model.train()
    for step, step_starts in enumerate(starts, start=1):
        windows = tokens[step_starts[:, None] + offsets].long().to(device)
        _, loss = model(windows[:, :-1], windows[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        recent_losses.append(loss.item())  # a device sync per step; the pre-training is short and runs once
        if step % 50 == 0 or step == recipe.steps:
            mean_loss = sum(recent_losses) / len(recent_losses)
            rank_zero_info(f"base: step {step}/{recipe.steps}, train loss {mean_loss:.3f}")
            recent_losses.clear()
            if not math.isfinite(mean_loss):
                raise RuntimeError(
                    f"The base's pre-training diverged (train loss {mean_loss}); lower pretrain_learning_rate."
                )
    seconds = time.perf_counter() - started
    state = {name: tensor.detach().cpu() for name, tensor in model.state_dict().items()}
    return state, {"seconds": seconds, "final_train_loss": mean_loss}


def _read_cache(path: pathlib.Path, settings: dict[str, Any]) -> tuple[dict[str, torch.Tensor] | None, str]:
    """``(state, "")`` for a sound cache entry, else ``(None, what is wrong with it)``."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
        return None, f"it does not load: {type(error).__name__}: {error}"
    if not isinstance(saved, dict) or not isinstance(saved.get("state_dict"), dict):
        return None, "it holds no state_dict"
    if saved.get("settings") != json.dumps(settings, sort_keys=True):
        return None, "it was made with other settings"
    if saved.get("checksum") != state_checksum(saved["state_dict"]):
        return None, "its weights do not match their checksum"
    return saved["state_dict"], ""


def _write_cache(
    path: pathlib.Path, settings: dict[str, Any], state: dict[str, torch.Tensor], record: dict[str, Any]
) -> None:
    """Write to a temporary name, then rename: the final name holds either nothing or a whole file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    payload = {
        "settings": json.dumps(settings, sort_keys=True),
        "record": json.dumps(record),
        "state_dict": state,
        "checksum": state_checksum(state),
    }
    try:
        torch.save(payload, partial)
        os.replace(partial, path)  # atomic on one file system; two runs racing both write whole files
    finally:
        partial.unlink(missing_ok=True)


def load_base_weights(path: str, model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights in ``path`` for ``model`` (a :class:`GPT`), checked by name and shape.

    ``path`` is a Lightning checkpoint of a :class:`~lightning_zenflow.demo.CausalLMModule` (its ``model.`` prefix
    is dropped) or a plain state dict of a :class:`GPT`.

    Raises:
        ValueError: the file is missing or unreadable, holds no GPT weights, or weights of another shape; the
            message names the option and the fix.
    """
    file = pathlib.Path(path).expanduser()
    if not file.is_file():
        raise ValueError(f"model.base_checkpoint={path!r} does not exist. {CHECKPOINT_HINT}")
    try:
        saved = torch.load(file, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError) as error:
        raise ValueError(
            f"model.base_checkpoint={path!r} ({file.stat().st_size} bytes) is not a readable torch file "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). {CHECKPOINT_HINT}"
        ) from error
    state = saved.get("state_dict", saved) if isinstance(saved, dict) else None
    if isinstance(state, dict) and any(isinstance(key, str) and key.startswith("model.") for key in state):
        state = {key.removeprefix("model."): value for key, value in state.items() if key.startswith("model.")}
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"model.base_checkpoint={path!r} holds no model weights. {CHECKPOINT_HINT}")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shapes = [
        f"{name} {tuple(state[name].shape)} (the model has {tuple(expected[name].shape)})"
        for name in sorted(set(expected) & set(state))
        if state[name].shape != expected[name].shape
    ]
    if missing or unexpected or shapes:
        problems = []
        if missing:
            problems.append(f"it lacks {len(missing)} weights ({_first_few(missing)})")
        if unexpected:
            problems.append(f"it has {len(unexpected)} the model lacks ({_first_few(unexpected)})")
        if shapes:
            problems.append(f"shapes differ: {_first_few(shapes)}")
        raise ValueError(
            f"model.base_checkpoint={path!r} does not fit the model: {'; '.join(problems)}. Give the model the base's "
            "shape (model.n_layer, n_head, n_embd, block_size, as in the base's own config)."
        )
    return state


def _first_few(items: list[str], count: int = 3) -> str:
    return ", ".join(items[:count]) + (", ..." if len(items) > count else "")
