"""The main job's base model: the standard library's two corpora, the pre-training cache (reuse, damage, settings),
a base checkpoint of the user's, and the errors for bad input (CPU, tiny sizes)."""

from __future__ import annotations

import pathlib

import lightning
import pytest
import torch

from lightning_zenflow.demo import CausalLMModule, GPTConfig, load_corpus_bytes
from lightning_zenflow.demo import base as base_module
from lightning_zenflow.demo.base import (
    PretrainRecipe,
    base_settings,
    cache_path,
    load_base_weights,
    load_or_pretrain_base,
)
from lightning_zenflow.demo.stdlib import split_docstrings
from lightning_zenflow.strategies.telemetry import ZenFlowTelemetry

TINY_MODEL = {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16}
CPU = torch.device("cpu")


@pytest.fixture
def text_file(tmp_path: pathlib.Path) -> pathlib.Path:
    path = tmp_path / "code.txt"
    path.write_text("".join(f"def function_{n}(x):\n    return x * {n}\n\n" for n in range(400)))
    return path


def _recipe(text_file: pathlib.Path, **changes: object) -> PretrainRecipe:
    settings: dict[str, object] = {"data_path": str(text_file), "max_bytes": 20_000, "steps": 3, "batch_size": 2}
    settings.update(changes)
    return PretrainRecipe(**settings)  # type: ignore[arg-type]


def _no_pretraining(*args: object) -> None:
    raise AssertionError("pre-trained although a sound cached base exists")


# ---------------------------------------------------------------------------------------------------- the corpora


def test_split_docstrings_moves_docstrings_out_of_the_code() -> None:
    source = '"""Module doc."""\nimport os\n\n\ndef f(x):\n    """Doc of f,\n    two lines."""\n    return x  # kept\n'
    code, docstrings = split_docstrings(source)
    assert docstrings == ["Module doc.", "Doc of f,\ntwo lines."]
    assert code == "import os\n\n\ndef f(x):\n    return x  # kept\n"
    assert split_docstrings('def g(): "inline"\n') == ('def g(): "inline"\n', ["inline"])  # shares a line: stays


def test_stdlib_code_and_docs_are_different_text() -> None:
    code = bytes(load_corpus_bytes(None, 150_000, stdlib_text="code").tolist())
    docs = bytes(load_corpus_bytes(None, 150_000, stdlib_text="docs").tolist())
    assert b"def " in code
    assert b'"""' not in code[:20_000]
    assert b"def " not in docs[:20_000] or docs.count(b"def ") < code.count(b"def ") / 20
    with pytest.raises(ValueError, match="stdlib_text='prose' must be one of"):
        load_corpus_bytes(None, 100, stdlib_text="prose")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- the cache


def test_cache_is_reused(text_file: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, recipe = GPTConfig(**TINY_MODEL), _recipe(text_file)
    threads = torch.get_num_threads()
    first = load_or_pretrain_base(config, recipe, tmp_path / "cache")
    assert torch.get_num_threads() == threads, "the pre-training's single thread is given back"
    cached = list((tmp_path / "cache").iterdir())
    assert [path.name for path in cached] == [cache_path(tmp_path / "cache", base_settings(config, recipe, CPU)).name]
    monkeypatch.setattr(base_module, "pretrain_base", _no_pretraining)
    second = load_or_pretrain_base(config, recipe, tmp_path / "cache")
    assert second.keys() == first.keys()
    assert all(torch.equal(second[name], first[name]) for name in first)


@pytest.mark.parametrize("damage", ["truncated", "flipped_bytes", "empty", "not_torch"])
def test_a_damaged_cache_is_rebuilt(text_file: pathlib.Path, tmp_path: pathlib.Path, damage: str) -> None:
    config, recipe = GPTConfig(**TINY_MODEL), _recipe(text_file)
    original = load_or_pretrain_base(config, recipe, tmp_path)
    path = cache_path(tmp_path, base_settings(config, recipe, CPU))
    content = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(content[: len(content) // 2])
    elif damage == "flipped_bytes":
        # inside a tensor's data, which torch.load does not check: only the checksum notices
        position = content.find(original["lm_head.weight"].numpy().tobytes())
        assert position > 0
        path.write_bytes(content[:position] + b"\xff" * 8 + content[position + 8 :])
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.write_text("not a torch file")
    with pytest.warns(UserWarning, match="unusable"):
        rebuilt = load_or_pretrain_base(config, recipe, tmp_path)
    assert all(torch.equal(rebuilt[name], original[name]) for name in original), "pre-training is deterministic"
    assert path.read_bytes() != b""
    assert not list(tmp_path.glob(".*partial"))


def test_other_settings_make_another_base(text_file: pathlib.Path, tmp_path: pathlib.Path) -> None:
    config, recipe = GPTConfig(**TINY_MODEL), _recipe(text_file)
    first = load_or_pretrain_base(config, recipe, tmp_path)
    longer = load_or_pretrain_base(config, _recipe(text_file, steps=4), tmp_path)
    wider = load_or_pretrain_base(GPTConfig(**{**TINY_MODEL, "n_embd": 32}), recipe, tmp_path)
    text_file.write_text(text_file.read_text() + "# edited\n")  # the data changed: its fingerprint too
    edited = load_or_pretrain_base(config, recipe, tmp_path)
    assert len(list(tmp_path.glob("base-*.pt"))) == 4
    assert not torch.equal(first["lm_head.weight"], longer["lm_head.weight"])
    assert wider["lm_head.weight"].shape == (256, 32)
    assert not torch.equal(first["lm_head.weight"], edited["lm_head.weight"])


def test_the_module_pretrains_at_setup_then_fine_tunes_from_the_cache(
    text_file: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    module = CausalLMModule(**TINY_MODEL, pretrain_steps=3, pretrain_data_path=str(text_file), pretrain_batch_size=2,
                            pretrain_max_bytes=20_000, seed_model=1)  # fmt: skip
    fresh = module.model.lm_head.weight.detach().clone()
    trainer = lightning.Trainer(default_root_dir=tmp_path, accelerator="cpu", logger=False, max_steps=1)
    trainer.strategy.connect(module)
    module.trainer = trainer
    module.setup("fit")
    expected = load_or_pretrain_base(module.model.config, module_recipe(text_file), tmp_path / "base_cache")
    assert torch.equal(module.model.lm_head.weight, expected["lm_head.weight"])
    assert not torch.equal(module.model.lm_head.weight, fresh)


def test_a_checkpoint_loaded_into_the_module_is_not_replaced_by_the_base(text_file: pathlib.Path) -> None:
    module = CausalLMModule(**TINY_MODEL, pretrain_steps=3, pretrain_data_path=str(text_file))
    module.on_load_checkpoint({"state_dict": module.state_dict()})  # what load_from_checkpoint and ckpt_path call
    module.setup("validate")  # would need a Trainer (for the cache folder) if it still meant to load a base


def module_recipe(text_file: pathlib.Path) -> PretrainRecipe:
    return PretrainRecipe(data_path=str(text_file), max_bytes=20_000, steps=3, batch_size=2)


# ---------------------------------------------------------------------------------------------------- a base of yours


def test_base_checkpoint_from_a_state_dict_or_a_lightning_checkpoint(tmp_path: pathlib.Path) -> None:
    source = CausalLMModule(**TINY_MODEL, seed_model=3)
    torch.save(source.model.state_dict(), tmp_path / "gpt.pt")
    torch.save({"state_dict": source.state_dict(), "hyper_parameters": {"n_layer": 1}}, tmp_path / "module.ckpt")
    for name in ("gpt.pt", "module.ckpt"):
        module = CausalLMModule(**TINY_MODEL, seed_model=4, base_checkpoint=str(tmp_path / name), pretrain_steps=5)
        assert all(
            torch.equal(a, b) for a, b in zip(module.model.state_dict().values(), source.model.state_dict().values())
        )


def test_bad_base_checkpoints_name_the_option_and_the_fix(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"model.base_checkpoint='.*missing.ckpt' does not exist\. Pass"):
        CausalLMModule(**TINY_MODEL, base_checkpoint=str(tmp_path / "missing.ckpt"))
    (tmp_path / "text.ckpt").write_text("not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable torch file"):
        CausalLMModule(**TINY_MODEL, base_checkpoint=str(tmp_path / "text.ckpt"))
    torch.save({"epoch": 3}, tmp_path / "empty.ckpt")
    with pytest.raises(ValueError, match="holds no model weights"):
        CausalLMModule(**TINY_MODEL, base_checkpoint=str(tmp_path / "empty.ckpt"))
    torch.save(CausalLMModule(**{**TINY_MODEL, "n_embd": 32}).model.state_dict(), tmp_path / "wide.pt")
    with pytest.raises(ValueError, match=r"does not fit the model: shapes differ: .*Give the model the base's shape"):
        CausalLMModule(**TINY_MODEL, base_checkpoint=str(tmp_path / "wide.pt"))
    with pytest.raises(ValueError, match=r"it lacks 12 weights \(blocks.1.attn.proj.bias, .*, \.\.\.\)"):
        load_base_weights(str(tmp_path / "wide.pt"), CausalLMModule(**{**TINY_MODEL, "n_embd": 32, "n_layer": 2}).model)


def test_bad_pretraining_settings_fail_when_the_module_is_built(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="pretrain_data_path='.*nowhere' does not exist"):
        CausalLMModule(**TINY_MODEL, pretrain_steps=5, pretrain_data_path=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="pretrain_steps=-1 must be 0"):
        CausalLMModule(**TINY_MODEL, pretrain_steps=-1)
    with pytest.raises(ValueError, match="pretrain_batch_size=0 must be at least 1"):
        CausalLMModule(**TINY_MODEL, pretrain_steps=5, pretrain_batch_size=0)
    with pytest.raises(ValueError, match="pretrain_learning_rate=0.0 must be positive"):
        CausalLMModule(**TINY_MODEL, pretrain_steps=5, pretrain_learning_rate=0.0)
    CausalLMModule(**TINY_MODEL, pretrain_steps=0, pretrain_data_path=str(tmp_path / "nowhere"))  # unused: no error


# ---------------------------------------------------------------------------------------------------- summary line


def test_the_summary_line_shows_the_reference() -> None:
    label = "AdamW reference for this job"
    telemetry = ZenFlowTelemetry(
        loss_key="val_loss", reference_loss=2.0, reference_label=label, reference_note="see README"
    )
    telemetry.summary.steps, telemetry.summary.wall_s, telemetry.summary.final_loss = 200, 61.0, 2.1
    line = telemetry.summary_line()
    assert line.startswith("ZenFlow run summary: 200 optimizer steps in 61.0 s, final val_loss 2.1000 ")
    assert "(AdamW reference for this job: 2.0000, +5.0 %, see README), stall share" in line
    assert telemetry.summary_line(zenflow=False).startswith("Run summary: 200 optimizer steps")
    with pytest.raises(ValueError, match="reference_loss=0"):
        ZenFlowTelemetry(reference_loss=0)
