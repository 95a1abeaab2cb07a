"""What the tests of lightning_zenflow.llm share: a word-level tokenizer and a tiny random Llama built here (no
downloads), the held-out loss as ``CausalLMFineTune`` logs it, and one fit of the LLM fine-tune for the multi-rank
tests (``tests/test_llm_distributed.py``), run by every rank (``tests/rank_zygote.py`` forks them, and
``ddp_script.run`` calls :func:`fit` for options with ``"entry": "llm_helpers:fit"``) or in the test process.

``transformers`` and ``tokenizers`` are imported where they are used: the test modules skip without them.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import random
from typing import Any

import torch

SPECIAL_TOKENS = ["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|end|>"]
WORDS = [
    "hi",
    "there",
    "hello",
    "friend",
    "how",
    "are",
    "you",
    "fine",
    "thanks",
    "alpha",
    "beta",
    "gamma",
    "delta",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
]
VOCAB = {token: index for index, token in enumerate(SPECIAL_TOKENS + WORDS)}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def save_tokenizer(folder: pathlib.Path, chat_template: str | None) -> None:
    """A word-level tokenizer over ``VOCAB`` (whitespace-split; the special tokens are matched whole)."""
    import tokenizers
    import transformers

    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    backend.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>"
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(folder)


def save_tiny_llama(folder: pathlib.Path) -> pathlib.Path:
    """A tiny random Llama with tied embeddings (as SmolLM2 has) and the chat tokenizer, saved in ``folder``. Every
    row count is even: FSDP2 gives each of 2 ranks a block of every parameter."""
    sizes = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    return save_random_llama(folder, None, vocab_size=300, num_attention_heads=4, num_key_value_heads=2, **sizes)


def write_text(path: pathlib.Path, blocks: int, block_size: int, seed: int = 0) -> pathlib.Path:
    """A text file of random ``WORDS`` that packs into exactly ``blocks`` blocks of ``block_size`` tokens (one token
    a word, and the EOS token the data module adds after the document)."""
    words = random.Random(seed).choices(WORDS, k=blocks * block_size - 1)
    path.write_text(" ".join(words) + "\n")
    return path


def mean_loss(model: torch.nn.Module, loader: torch.utils.data.DataLoader) -> float:
    """The sequence-weighted mean of the model's batch losses, as ``CausalLMFineTune`` logs ``val_loss``."""
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in loader:
            total += float(model(**batch).loss) * batch["input_ids"].size(0)
            count += batch["input_ids"].size(0)
    return total / count


# ------------------------------------------------------------------------------------------ the multi-rank fit


def text_batch(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A batch of whole text blocks as ``CausalLMDataModule`` makes it: every token attended and in the loss."""
    input_ids = torch.stack(rows)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)
"""A hung peer fails the fit within a minute."""


def fit(out: pathlib.Path, options: dict) -> dict[str, Any]:
    """Fit ``CausalLMFineTune`` on ``CausalLMDataModule`` (a text file) with ``options["strategy"]`` (``"zenflow"``,
    ``"zenflow_ddp"`` or ``"zenflow_fsdp"``, its knobs in ``options["knobs"]``) on ``options["devices"]`` CPU ranks
    at peak learning rate ``options["lr"]`` (1 step of warm-up), validating at the end of the one epoch and
    exporting into ``out/export`` (and with ``options["sample_prompt"]``, generating 3 tokens after it). Every rank
    writes (and returns) its results, ``out/rank{r}.pt``: the batches it trained on, each validation's step and
    ``val_loss``, whether the model was sharded and its embeddings tied during fit, how often the MLP of its first
    decoder layer ran in training mode (forwards, and recomputations under activation checkpointing), the sample (rank
    0) and the final weights (gathered whole under FSDP2).

    ``options["checkpoint_every"]`` adds a ``ModelCheckpoint`` saving every that many steps into ``out/ckpt`` (all
    kept), ``options["ckpt_path"]`` resumes the fit from a checkpoint, and ``options["module"]`` holds further
    arguments of ``CausalLMFineTune`` (``activation_checkpointing``, ``export_on_checkpoint``, ...).

    The data module is the package's own, with Lightning's distributed sampler over the ranks; ``options["replay"]``
    (a list of batches of text blocks, token ids) replaces its training batches with these, in this order: one
    process then trains on the global batches a multi-rank fit recorded (resumed from a checkpoint of that fit, on
    those after the checkpoint's: the loader keeps its place as the data module's does)."""
    import lightning
    from ddp_script import full_weights
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.distributed.tensor import DTensor

    import lightning_zenflow
    from lightning_zenflow.llm import CausalLMDataModule, CausalLMFineTune
    from lightning_zenflow.llm.resume import ResumableLoader

    class Replay(CausalLMDataModule):
        def train_dataloader(self) -> torch.utils.data.DataLoader:
            rows = torch.tensor([row for batch in options["replay"] for row in batch])
            return ResumableLoader(
                rows, batch_size=self.batch_size, collate_fn=text_batch, trainer=lambda: self.trainer
            )

    class Record(Callback):
        def __init__(self) -> None:
            self.batches: list[list[list[int]]] = []
            self.validations: list[tuple[int, float]] = []
            self.sharded: bool | None = None
            self.tied: bool | None = None
            self.mlp_calls = 0

        def on_train_start(self, trainer: lightning.Trainer, pl_module: Any) -> None:
            output = pl_module.model.get_output_embeddings().weight
            self.sharded = isinstance(output, DTensor)
            self.tied = output is pl_module.model.get_input_embeddings().weight
            # a module inside the layer: the layer's own hooks (FSDP2's) stay outside what checkpointing reruns
            pl_module.model.model.layers[0].mlp.register_forward_pre_hook(self.count_mlp_call)

        def count_mlp_call(self, mlp: torch.nn.Module, _: Any) -> None:
            self.mlp_calls += mlp.training  # the training forwards, and their recomputations in backward

        def on_train_batch_start(self, trainer: lightning.Trainer, pl_module: Any, batch: Any, *_: Any) -> None:
            self.batches.append(batch["input_ids"].tolist())

        def on_validation_end(self, trainer: lightning.Trainer, pl_module: Any) -> None:
            self.validations.append((trainer.global_step, float(trainer.callback_metrics["val_loss"])))

    devices = int(options["devices"])
    knobs = {"full_warm_up_rounds": 0, "host_threads": 1, "bind_cores": False, **options.get("knobs", {})}
    name = options["strategy"]
    if name == "zenflow":
        strategy: Any = lightning_zenflow.ZenFlowStrategy(**knobs)
    elif name == "zenflow_ddp":
        strategy = lightning_zenflow.ZenFlowDDPStrategy(timeout=COLLECTIVE_TIMEOUT, **knobs)
    else:
        strategy = lightning_zenflow.ZenFlowFSDPStrategy(timeout=COLLECTIVE_TIMEOUT, **knobs)
    data_class = Replay if options.get("replay") else CausalLMDataModule
    datamodule = data_class(
        options["data_path"],
        options["model_dir"],
        block_size=options["block_size"],
        batch_size=options["batch_size"],
        val_fraction=options["val_fraction"],
    )
    module = CausalLMFineTune(
        options["model_dir"],
        lr=options["lr"],
        warmup_steps=1,
        export_dir=str(out / "export"),
        sample_prompt=options.get("sample_prompt"),
        sample_tokens=3,
        **options.get("module", {}),
    )
    record = Record()
    callbacks: list[Callback] = [record]
    if options.get("checkpoint_every"):
        every = ModelCheckpoint(dirpath=out / "ckpt", every_n_train_steps=options["checkpoint_every"], save_top_k=-1)
        callbacks.append(every)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=options["max_steps"],
        max_epochs=1,
        logger=False,
        enable_checkpointing=len(callbacks) > 1,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        # a replay is the batches in their order: no distributed sampler (it shuffles, at one rank of FSDP2 too)
        use_distributed_sampler=not options.get("replay"),
        callbacks=callbacks,
        default_root_dir=str(out),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=options.get("ckpt_path"))
    result = {
        "strategy": type(trainer.strategy).__name__,
        "world_size": trainer.world_size,
        "global_step": trainer.global_step,
        "batches": record.batches,
        "validations": record.validations,
        "sharded": record.sharded,
        "tied": record.tied,
        "mlp_calls": record.mlp_calls,
        "sample": module.last_sample,
        "weights": full_weights(module.model),  # FSDP2: a collective, every rank gathers
    }
    torch.save(result, out / f"rank{trainer.global_rank}.pt")
    return result


# --------------------------------------------------------------------- sharded loading and export (FSDP2 ranks)

LOADING_LLAMA = {
    "vocab_size": 16384,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
"""A Llama of 46.9 M parameters (188 MB in float32, its largest tensor the tied 16384 x 512 embeddings, 33.6 MB): large
enough that a rank's share of it stands well above the noise of a process's resident memory (a few MiB)."""


def save_random_llama(folder: pathlib.Path, max_shard_size: str | None, **sizes: int) -> pathlib.Path:
    """A random Llama of ``sizes`` (``LlamaConfig`` fields; tied embeddings) saved in ``folder`` in safetensors files
    of at most ``max_shard_size`` (None: ``save_pretrained``'s default), with the test tokenizer."""
    import transformers

    config = transformers.LlamaConfig(
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=VOCAB["<pad>"],
        eos_token_id=VOCAB["<eos>"],
        bos_token_id=None,
        **sizes,
    )
    torch.manual_seed(0)
    limit = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    transformers.LlamaForCausalLM(config).save_pretrained(folder, **limit)
    save_tokenizer(folder, CHAT_TEMPLATE)
    return folder


TINY_MOE = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "moe_intermediate_size": 16, "head_dim": 8, "decoder_sparse_step": 1},
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 8, "intermediate_size": 16}),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "num_local_experts": 8,
            "intermediate_size": 16,
            "head_dim": 8,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 16,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}
"""Tiny mixture-of-experts configurations (8 experts, 2 a token, 2 layers, hidden 32) of three ways ``transformers``
5 holds experts: Qwen3-MoE (files of per-expert tensors, fused into ``[experts, out, in]`` by stacking and
concatenating), Mixtral (the same rule over other names, with a rename) and GPT-OSS (fused ``[experts, in, out]`` in
the files as in the module, biases too; no rule)."""


def save_random_moe(
    folder: pathlib.Path, architecture: str = "qwen3_moe", max_shard_size: str | int | None = None, **sizes: Any
) -> pathlib.Path:
    """A random mixture-of-experts model of ``architecture`` (a key of :data:`TINY_MOE`; ``sizes`` override its
    config), tied embeddings, saved with ``save_pretrained`` in ``folder`` (what ``transformers`` writes: per-expert
    tensors for Qwen3-MoE and Mixtral, fused ones for GPT-OSS), in files of at most ``max_shard_size``, with the test
    tokenizer. Every row count is even: FSDP2 gives each of 2 (and 4) ranks a block of every parameter, 2 experts a
    rank at 4."""
    import transformers

    config_class, model_class, own = TINY_MOE[architecture]
    tiny = {
        "vocab_size": 300,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_experts_per_tok": 2,
    }
    config = getattr(transformers, config_class)(
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=VOCAB["<pad>"],
        eos_token_id=VOCAB["<eos>"],
        bos_token_id=None,
        **{**tiny, **own, **sizes},
    )
    torch.manual_seed(0)
    limit = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    getattr(transformers, model_class)(config).save_pretrained(folder, **limit)
    save_tokenizer(folder, CHAT_TEMPLATE)
    return folder


def save_random_qwen3_moe(folder: pathlib.Path, max_shard_size: str | int | None = None, **sizes: Any) -> pathlib.Path:
    """A random Qwen3-MoE (:data:`TINY_MOE`'s, ``sizes`` overriding ``Qwen3MoeConfig`` fields) saved in ``folder``:
    :func:`save_random_moe`."""
    return save_random_moe(folder, "qwen3_moe", max_shard_size, **sizes)


def peak_kib() -> int:
    """This process's peak resident memory (``VmHWM``), in KiB."""
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    """Set ``VmHWM`` to the current resident memory (Linux: writing 5 to ``/proc/self/clear_refs``)."""
    pathlib.Path("/proc/self/clear_refs").write_text("5")


def sharded_load(out: pathlib.Path, options: dict) -> dict[str, Any]:
    """On every rank (``tests/rank_zygote.py``): build ``options["model_dir"]``'s model as ``CausalLMFineTune`` does
    (parameters on meta, buffers on the host), shard it over all ranks with FSDP2 (with ``options["replicas"]``, HSDP:
    a 2-D mesh of that many replicas of shard groups) and read each rank's rows
    (``load_sharded``), for every dtype of ``options["dtypes"]``; then export each with ``write_sharded`` into
    ``out/export-<dtype>-<limit>`` for every size limit of ``options["export_limits"]``.

    Writes (and returns) ``out/rank{r}.pt``: per dtype, the weights gathered whole (on every rank; not with
    ``options["gather"]`` false), the buffers, whether the embeddings are one parameter, this rank's peak resident
    memory (``VmHWM``, KiB) after the model was built and sharded on meta and after it was loaded (reset to the
    resident memory before the build), the bytes it read from the weight files, and with ``options["compare_rows"]``
    the names whose rows differ from ``from_pretrained``'s (:func:`differing_rows`, after the measurement)."""
    import torch.distributed as dist
    import transformers
    from ddp_script import full_weights
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_zenflow.llm.sharded_export import write_sharded
    from lightning_zenflow.llm.sharded_load import structure
    from lightning_zenflow.llm.sharding import load_sharded, shard_blocks

    rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    on_cuda = options.get("device") == "cuda"  # one GPU per rank over NCCL (tests/test_gpu.py)
    device = torch.device("cuda", rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if on_cuda else "gloo", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        if options.get("replicas"):  # HSDP: shard groups of world / replicas ranks, replicated
            shape = (options["replicas"], world // options["replicas"])
            mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("data_parallel",))
        config = transformers.AutoConfig.from_pretrained(options["model_dir"])
        result: dict[str, Any] = {"rank": rank, "world": world, "loads": {}}
        for dtype_name in options["dtypes"]:
            dtype = getattr(torch, dtype_name)
            dist.barrier()  # each rank's peak is its own: the ranks start together, no rank still freeing
            reset_peak()
            before_kib = peak_kib()
            model = structure(config, dtype)
            shard_blocks(model, mesh)  # on meta: the structure, sharded, holds no weight
            meta_kib = peak_kib()
            read_bytes = load_sharded(model, options["model_dir"], mesh, device)
            loaded_kib = peak_kib()
            output = model.get_output_embeddings().weight
            result["loads"][dtype_name] = {
                "before_kib": before_kib,
                "meta_kib": meta_kib,
                "loaded_kib": loaded_kib,
                "read_bytes": read_bytes,
                "tied": output is model.get_input_embeddings().weight,
                "sharded": type(output).__name__ == "DTensor",
                "weights": full_weights(model) if options.get("gather", True) else None,
                "dtypes": {name: param.dtype for name, param in model.named_parameters()},
                "buffers": {name: buffer.cpu().clone() for name, buffer in model.named_buffers()},
                "differ": differing_rows(model, options["model_dir"], dtype) if options.get("compare_rows") else None,
            }
            for limit in options.get("export_limits", []):
                write_sharded(model, out / f"export-{dtype_name}-{limit}", limit, rank == 0)
                dist.barrier()  # rank 0 has written the folder
            del model
    finally:
        dist.destroy_process_group()
    torch.save(result, out / f"rank{rank}.pt")
    return result


def differing_rows(model: torch.nn.Module, model_dir: str, dtype: torch.dtype) -> list[str]:
    """The parameters and buffers of a sharded ``model`` whose local rows differ (bitwise) from the same rows of
    ``from_pretrained(model_dir)``: each rank checks its own rows, nothing is gathered."""
    import transformers

    from lightning_zenflow.llm.sharded_load import local_rows

    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    differ = []
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        local, start, stop = local_rows(tensor.detach())
        whole = expected[name].detach()
        if not torch.equal(local, whole[start:stop] if whole.dim() else whole):
            differ.append(name)
    return differ
