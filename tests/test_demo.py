"""Tests of the demo data module and models (CPU, tiny configurations)."""

from __future__ import annotations

import math
import pathlib
import sys

import lightning
import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_zenflow.demo import (
    GPT,
    ByteCorpusDataModule,
    CausalLMModule,
    GPTConfig,
    default_corpus_files,
    load_corpus_bytes,
)
from lightning_zenflow.demo.data import FILE_SEPARATOR

TINY_MODEL = {"block_size": 32, "n_layer": 1, "n_head": 2, "n_embd": 32}
NO_TRANSFORMERS = "the Hugging Face wrapper needs `pip install 'lightning-zenflow[transformers]'`"


def _numbered_lines(count: int) -> bytes:
    """Text whose every line is unique, so a byte's line number says where in the corpus it came from."""
    return b"".join(f"line {number:06d} of the test corpus\n".encode() for number in range(count))


def _line_numbers(tokens: torch.Tensor) -> set[int]:
    text = bytes(tokens.tolist()).decode()
    return {int(line.split()[1]) for line in text.splitlines() if line.startswith("line ") and len(line.split()) > 2}


@pytest.fixture
def corpus_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "corpus.txt"
    path.write_bytes(_numbered_lines(2000))  # 64 kB
    return path


def _trainer(**overrides: object) -> lightning.Trainer:
    settings: dict[str, object] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_steps": 5,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
    }
    settings.update(overrides)
    return lightning.Trainer(**settings)


class _RecordTrainLoss(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: ANN001
        self.losses.append(float(outputs["loss"]))


# ---------------------------------------------------------------------------------------------------- corpus loading


def test_default_corpus_is_the_stdlib_without_tests_or_site_packages() -> None:
    files = default_corpus_files()
    assert len(files) > 100
    assert files == sorted(files)
    assert all(path.suffix == ".py" for path in files)
    excluded = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"}
    assert not any(excluded.intersection(path.parts) for path in files)
    corpus = load_corpus_bytes(None, max_bytes=100_000)
    assert corpus.dtype == torch.uint8
    assert corpus.numel() == 100_000
    assert b"def " in bytes(corpus.tolist())


def test_single_file_is_read_whole_and_capped(corpus_file: pathlib.Path) -> None:
    expected = corpus_file.read_bytes()
    assert bytes(load_corpus_bytes(str(corpus_file), max_bytes=10**9).tolist()) == expected
    assert bytes(load_corpus_bytes(str(corpus_file), max_bytes=100).tolist()) == expected[:100]


def test_folder_reads_text_files_in_sorted_order_and_skips_binary(tmp_path: pathlib.Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / ".git").mkdir()
    (tmp_path / "b.txt").write_bytes(b"second file")
    (tmp_path / "a.txt").write_bytes(b"first file")
    (tmp_path / "sub" / "c.md").write_bytes("third file \u00e9".encode())
    (tmp_path / "image.bin").write_bytes(b"\x89PNG\x00\x01\x02")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / ".git" / "HEAD").write_bytes(b"ref: refs/heads/main")
    corpus = bytes(load_corpus_bytes(str(tmp_path), max_bytes=10**6).tolist())
    assert corpus == FILE_SEPARATOR.join([b"first file", b"second file", "third file \u00e9".encode()])


def test_loading_errors_name_the_problem(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="data_path"):
        load_corpus_bytes(str(tmp_path / "missing"), max_bytes=100)
    (tmp_path / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="no readable UTF-8 text files"):
        load_corpus_bytes(str(tmp_path), max_bytes=100)
    with pytest.raises(ValueError, match="not a readable UTF-8 text file"):
        load_corpus_bytes(str(tmp_path / "blob.bin"), max_bytes=100)
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus_bytes(None, max_bytes=0)
    short_file = tmp_path / "short.txt"
    short_file.write_bytes(b"x" * 100)
    data = ByteCorpusDataModule(data_path=str(short_file), block_size=64, batch_size=1)
    with pytest.raises(ValueError, match="too short for block_size=64"):
        data.setup("fit")


# ---------------------------------------------------------------------------------------------------- splits, batches


def test_halves_are_disjoint_and_cover_the_corpus(corpus_file: pathlib.Path) -> None:
    corpus = load_corpus_bytes(str(corpus_file), max_bytes=10**9)
    halves = {}
    for part in ("first_half", "second_half"):
        data = ByteCorpusDataModule(data_path=str(corpus_file), block_size=16, batch_size=4, part=part)
        data.setup("fit")
        halves[part] = torch.cat([data.train_tokens, data.val_tokens])
    assert torch.equal(torch.cat([halves["first_half"], halves["second_half"]]), corpus)
    first_lines, second_lines = _line_numbers(halves["first_half"]), _line_numbers(halves["second_half"])
    assert len(first_lines) > 900
    assert len(second_lines) > 900
    assert not first_lines & second_lines


def test_validation_split_follows_train_without_overlap(corpus_file: pathlib.Path) -> None:
    data = ByteCorpusDataModule(data_path=str(corpus_file), block_size=16, batch_size=4, val_fraction=0.1)
    data.setup("fit")
    corpus = load_corpus_bytes(str(corpus_file), max_bytes=10**9)
    assert torch.equal(torch.cat([data.train_tokens, data.val_tokens]), corpus)
    assert data.val_tokens.numel() == pytest.approx(0.1 * corpus.numel(), abs=1)
    train_lines, val_lines = _line_numbers(data.train_tokens), _line_numbers(data.val_tokens)
    assert max(train_lines) <= min(val_lines)  # one line may straddle the boundary, no more
    val_x, val_y = next(iter(data.val_dataloader()))
    assert torch.equal(val_x[0], data.val_tokens[:16].long())  # validation reads the tail in order
    assert torch.equal(val_y[0], data.val_tokens[1:17].long())


@pytest.mark.parametrize("samples_per_epoch", [None, 40])
def test_batches_are_shifted_long_blocks(corpus_file: pathlib.Path, samples_per_epoch: int | None) -> None:
    data = ByteCorpusDataModule(
        data_path=str(corpus_file), block_size=16, batch_size=4, samples_per_epoch=samples_per_epoch
    )
    data.setup("fit")
    loader = data.train_dataloader()
    expected_batches = (data.train_tokens.numel() - 1) // 16 // 4 if samples_per_epoch is None else 10
    assert len(loader) == expected_batches
    corpus_text = bytes(data.train_tokens.tolist())
    for x, y in [next(iter(loader))]:
        assert x.shape == y.shape == (4, 16)
        assert x.dtype == y.dtype == torch.long
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row_x, row_y in zip(x, y):
            window = bytes(row_x.tolist()) + bytes(row_y[-1:].tolist())
            assert window in corpus_text
    assert data.vocab_size == 256


@pytest.mark.parametrize("samples_per_epoch", [None, 40])
def test_training_order_is_fixed_by_seed_and_epoch(corpus_file: pathlib.Path, samples_per_epoch: int | None) -> None:
    def epoch_batches(seed: int, epoch: int) -> torch.Tensor:
        data = ByteCorpusDataModule(
            data_path=str(corpus_file), block_size=16, batch_size=4, seed=seed, samples_per_epoch=samples_per_epoch
        )
        data.setup("fit")
        loader = data.train_dataloader()
        loader.sampler.set_epoch(epoch)
        return torch.cat([x for x, _ in loader])

    reference = epoch_batches(seed=0, epoch=0)
    assert torch.equal(reference, epoch_batches(seed=0, epoch=0))
    assert not torch.equal(reference, epoch_batches(seed=1, epoch=0))
    assert not torch.equal(reference, epoch_batches(seed=0, epoch=1))


# ---------------------------------------------------------------------------------------------------- models


def test_gpt_forward_backward_and_untied_parameters() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY_MODEL))
    idx = torch.randint(0, 256, (2, 32))
    logits, loss = model(idx, torch.roll(idx, -1, dims=1))
    assert logits.shape == (2, 32, 256)
    assert loss is not None
    assert loss.item() == pytest.approx(math.log(256), abs=0.3)  # near-uniform predictions at init
    loss.backward()
    assert all(param.grad is not None and param.grad.abs().sum() > 0 for param in model.parameters())
    storage_pointers = [param.data_ptr() for param in model.parameters()]
    assert len(set(storage_pointers)) == len(storage_pointers)
    assert model.lm_head.weight is not model.token_embedding.weight
    assert model.num_parameters() == sum(param.numel() for param in model.parameters())
    assert model(idx[:, :8])[1] is None
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, 33, dtype=torch.long))


def test_default_gpt_size() -> None:
    assert GPT(GPTConfig()).num_parameters() == 875_264
    with pytest.raises(ValueError, match="divisible by n_head"):
        GPTConfig(n_embd=130, n_head=4)


def test_seed_model_fixes_init_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    first, second = CausalLMModule(**TINY_MODEL, seed_model=7), CausalLMModule(**TINY_MODEL, seed_model=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))


def test_optimizer_has_decay_and_no_decay_groups() -> None:
    module = CausalLMModule(**TINY_MODEL, weight_decay=0.1)
    optimizer = module.configure_optimizers()
    assert type(optimizer) is torch.optim.AdamW
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1
    assert no_decay["weight_decay"] == 0.0
    assert all(param.ndim >= 2 for param in decay["params"])
    assert all(param.ndim == 1 for param in no_decay["params"])
    grouped = {id(param) for group in optimizer.param_groups for param in group["params"]}
    assert grouped == {id(param) for param in module.parameters()}
    assert not optimizer.defaults.get("fused")
    assert not optimizer.defaults.get("foreach")
    assert type(CausalLMModule(**TINY_MODEL, optimizer="adam").configure_optimizers()) is torch.optim.Adam


def test_warmup_then_cosine_schedule_factors() -> None:
    module = CausalLMModule(**TINY_MODEL, learning_rate=1.0, warmup_steps=4, lr_schedule="cosine",
                            max_steps_for_schedule=24)  # fmt: skip
    config = module.configure_optimizers()
    assert config["lr_scheduler"]["interval"] == "step"
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    learning_rates = []
    for _ in range(30):
        learning_rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert learning_rates[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert learning_rates[14] == pytest.approx(0.55)  # half-way down the cosine from 1 to 0.1
    assert learning_rates[24:] == pytest.approx([0.1] * 6)
    assert all(a >= b for a, b in zip(learning_rates[3:], learning_rates[4:]))
    assert scheduler.state_dict()["lr_lambdas"][0]["total_steps"] == 24  # stored, so a resumed run continues it


def test_module_fits_with_trainer_and_schedule_from_trainer(corpus_file: pathlib.Path) -> None:
    data = ByteCorpusDataModule(data_path=str(corpus_file), block_size=32, batch_size=8)
    module = CausalLMModule(**TINY_MODEL, warmup_steps=2, lr_schedule="cosine", seed_model=0)
    trainer = _trainer(max_steps=5, limit_val_batches=2, val_check_interval=5)
    trainer.fit(module, datamodule=data)
    assert trainer.global_step == 5
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.lr_lambdas[0].total_steps == 5  # taken from trainer.estimated_stepping_batches
    assert scheduler.last_epoch == 5  # stepped once per optimizer step
    assert math.isfinite(trainer.callback_metrics["train_loss"].item())
    assert math.isfinite(trainer.callback_metrics["val_loss"].item())
    test_loss = trainer.test(module, datamodule=data, verbose=False)[0]["test_loss"]
    assert 0 < test_loss < math.log(256) + 0.5
    predictions = trainer.predict(module, dataloaders=data.predict_dataloader())
    assert predictions[0]["predictions"].shape == (8, 32)


def test_loss_goes_down(corpus_file: pathlib.Path) -> None:
    data = ByteCorpusDataModule(data_path=str(corpus_file), block_size=32, batch_size=8, samples_per_epoch=400)
    module = CausalLMModule(**TINY_MODEL, learning_rate=3e-3, seed_model=0)
    recorder = _RecordTrainLoss()
    _trainer(max_steps=30, callbacks=[recorder]).fit(module, datamodule=data)
    assert len(recorder.losses) == 30
    first, last = sum(recorder.losses[:5]) / 5, sum(recorder.losses[-5:]) / 5
    assert last < first - 1.0, f"loss fell only from {first:.3f} to {last:.3f}"


def test_lightning_cli_builds_model_and_data_from_flags(
    corpus_file: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.cli import LightningCLI

    monkeypatch.setattr(sys, "argv", ["lightning-zenflow"])  # pytest's own flags are not the CLI's
    cli = LightningCLI(
        CausalLMModule,
        ByteCorpusDataModule,
        run=False,
        seed_everything_default=False,
        args=["--model.n_layer=1", "--model.betas=[0.8, 0.9]", "--data.block_size=16", "--data.part=second_half",
              f"--data.data_path={corpus_file}", "--trainer.logger=false"],
    )  # fmt: skip
    assert cli.model.hparams.n_layer == 1
    assert tuple(cli.model.hparams.betas) == (0.8, 0.9)
    assert cli.datamodule.block_size == 16
    assert cli.datamodule.part == "second_half"


# ---------------------------------------------------------------------------------------------------- Hugging Face


def test_hf_module_explains_missing_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_zenflow.demo import HFCausalLMModule

    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'lightning-zenflow\[transformers\]'"):
        HFCausalLMModule()


def test_hf_module_trains_untied_random_gpt2(corpus_file: pathlib.Path) -> None:
    pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    from lightning_zenflow.demo import HFCausalLMModule

    module = HFCausalLMModule(config_overrides={"n_layer": 1}, learning_rate=1e-3, seed_model=0)
    assert module.model.config.n_layer == 1
    assert module.model.config.vocab_size == 256
    assert module.model.get_output_embeddings().weight is not module.model.get_input_embeddings().weight
    idx = torch.randint(0, 256, (2, 32))
    targets = torch.roll(idx, -1, dims=1)
    logits, loss = module(idx, targets)
    assert logits.shape == (2, 32, 256)
    expected_loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
    assert loss.item() == pytest.approx(expected_loss.item())  # targets are used as given, not shifted again
    decay, no_decay = module.configure_optimizers().param_groups
    assert decay["weight_decay"] == 0.0  # the module's default
    assert no_decay["weight_decay"] == 0.0
    assert all(param.ndim >= 2 for param in decay["params"])
    assert all(param.ndim == 1 for param in no_decay["params"])

    data = ByteCorpusDataModule(data_path=str(corpus_file), block_size=32, batch_size=8)
    recorder = _RecordTrainLoss()
    _trainer(max_steps=15, callbacks=[recorder]).fit(module, datamodule=data)
    assert recorder.losses[-1] < recorder.losses[0]
    with pytest.raises(ValueError, match="config_overrides"):
        HFCausalLMModule(model_name_or_path="gpt2", config_overrides={"n_layer": 1})


def test_hf_module_unties_a_pretrained_checkpoint(tmp_path: pathlib.Path) -> None:
    transformers = pytest.importorskip("transformers", reason=NO_TRANSFORMERS)
    from lightning_zenflow.demo import HFCausalLMModule

    # A local folder stands in for a hub model: same from_pretrained path, no network.
    tied_config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1, n_head=2)
    tied_model = transformers.AutoModelForCausalLM.from_config(tied_config)
    assert tied_model.get_output_embeddings().weight is tied_model.get_input_embeddings().weight
    tied_model.save_pretrained(tmp_path / "tiny-gpt2")

    model = HFCausalLMModule(model_name_or_path=str(tmp_path / "tiny-gpt2")).model
    output_weight, input_weight = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert output_weight is not input_weight
    assert output_weight.data_ptr() != input_weight.data_ptr()
    assert torch.equal(output_weight, input_weight)  # same values: untying changes no prediction
    assert model.config.tie_word_embeddings is False
