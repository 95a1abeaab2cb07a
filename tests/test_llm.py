"""Tests of lightning_zenflow.llm: the data module's formats, loss masks and errors, and a ZenFlow fit that exports a
Hugging Face folder (CPU, a tiny random Llama and a word-level tokenizer from tests/llm_helpers.py: no downloads)."""

from __future__ import annotations

import json
import pathlib
import shlex

import lightning
import pytest
import torch
from llm_helpers import CHAT_TEMPLATE, VOCAB, WORDS, mean_loss, save_tiny_llama, save_tokenizer

from lightning_zenflow import ZenFlowStrategy
from lightning_zenflow.cli import main
from lightning_zenflow.llm import CausalLMDataModule, CausalLMFineTune, DataError
from lightning_zenflow.llm.data import IGNORE_INDEX

transformers = pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")
tokenizers = pytest.importorskip("tokenizers", reason="the test tokenizer is built with `tokenizers`")

pytestmark = pytest.mark.usefixtures("no_leaked_children")


@pytest.fixture
def model_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A tiny random Llama with tied embeddings and the chat tokenizer, saved in one folder."""
    return save_tiny_llama(tmp_path / "model")


def _write_jsonl(path: pathlib.Path, lines: list[object]) -> pathlib.Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _ids(text: str) -> list[int]:
    return [VOCAB[word] for word in text.split()]


def _datamodule(data_path: pathlib.Path, tokenizer_path: pathlib.Path, **overrides: object) -> CausalLMDataModule:
    settings: dict[str, object] = {"block_size": 32, "batch_size": 2, "val_fraction": 0.2}
    settings.update(overrides)
    datamodule = CausalLMDataModule(str(data_path), str(tokenizer_path), **settings)
    datamodule.setup("fit")
    return datamodule


# ------------------------------------------------------------------------------------------------ instruction data


def test_chat_template_loss_covers_exactly_the_assistant_turns(tmp_path: pathlib.Path, model_dir: pathlib.Path) -> None:
    records = [
        {"prompt": "hi there", "response": "hello friend"},
        {
            "messages": [
                {"role": "user", "content": "how are you"},
                {"role": "assistant", "content": "fine"},
                {"role": "user", "content": "thanks"},
                {"role": "assistant", "content": "hello"},
            ]
        },
        {"prompt": "one", "response": "two"},  # held out
    ]
    datamodule = _datamodule(_write_jsonl(tmp_path / "chat.jsonl", records), model_dir, val_fraction=0.3)
    batch = next(iter(datamodule.val_dataloader()))
    assert batch["input_ids"].tolist() == [_ids("<|user|> one <|end|> <|assistant|> two <|end|>")]

    batch = next(iter(datamodule._loader(datamodule.train_samples, shuffle=False)))
    # the template, rendered by hand: "<|role|> content <|end|> " per turn
    first = _ids("<|user|> hi there <|end|> <|assistant|> hello friend <|end|>")
    first_labels = [IGNORE_INDEX] * 5 + _ids("hello friend <|end|>")
    second = _ids(
        "<|user|> how are you <|end|> <|assistant|> fine <|end|> <|user|> thanks <|end|> <|assistant|> hello <|end|>"
    )
    second_labels = [IGNORE_INDEX] * 6 + _ids("fine <|end|>") + [IGNORE_INDEX] * 4 + _ids("hello <|end|>")
    padding = len(second) - len(first)
    assert batch["input_ids"].tolist() == [first + [VOCAB["<pad>"]] * padding, second]
    assert batch["labels"].tolist() == [first_labels + [IGNORE_INDEX] * padding, second_labels]
    assert batch["attention_mask"].tolist() == [[1] * len(first) + [0] * padding, [1] * len(second)]


def test_without_a_chat_template_the_plain_format_learns_response_and_eos(tmp_path: pathlib.Path) -> None:
    save_tokenizer(tmp_path / "plain", chat_template=None)
    records = [{"prompt": "hi there", "response": "hello friend"}, {"prompt": "one", "response": "two"}]
    datamodule = _datamodule(_write_jsonl(tmp_path / "plain.jsonl", records), tmp_path / "plain", val_fraction=0.5)
    (sample,) = datamodule.train_samples
    assert sample["input_ids"] == _ids("hi there hello friend <eos>")
    assert sample["labels"] == [IGNORE_INDEX] * 2 + _ids("hello friend <eos>")


# ------------------------------------------------------------------------------------------------------- text data


def test_text_is_packed_into_blocks_with_eos_after_every_document(
    tmp_path: pathlib.Path, model_dir: pathlib.Path
) -> None:
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha beta gamma\n")
    (folder / "sub" / "b.md").write_text("one two three four five\n")
    (folder / "c.txt").write_text("six seven one two three four five six seven\n")
    (folder / "ignored.csv").write_text("delta delta\n")
    datamodule = _datamodule(folder, model_dir, block_size=4, val_fraction=0.3)

    eos = VOCAB["<eos>"]
    # sorted paths: a.txt < c.txt < sub/b.md, the last one held out; the 2 tokens after the last block are dropped
    train_stream = _ids("alpha beta gamma") + [eos] + _ids("six seven one two three four five six seven") + [eos]
    val_stream = _ids("one two three four five") + [eos]
    assert [s["input_ids"] for s in datamodule.train_samples] == [
        train_stream[0:4],
        train_stream[4:8],
        train_stream[8:12],
    ]
    assert [s["input_ids"] for s in datamodule.val_samples] == [val_stream[0:4]]
    assert datamodule.train_samples[0]["input_ids"][3] == eos  # the boundary between a.txt and c.txt
    batch = next(iter(datamodule.val_dataloader()))
    assert torch.equal(batch["labels"], batch["input_ids"])  # the model shifts
    assert batch["attention_mask"].all()


# -------------------------------------------------------------------------------------------------------- bad data


@pytest.mark.parametrize(
    ("lines", "block_size", "expected"),
    [
        ([], 32, r"empty\.jsonl, line 1: the file is empty\. Write one JSON object a line"),
        (['{"prompt": "hi", "response": "hello"}', "", "{not json"], 32, r"bad\.jsonl, line 3: not valid JSON"),
        (
            ['{"prompt": "hi", "response": "hello"}', '{"question": "hi", "answer": "hello"}'],
            32,
            r"bad\.jsonl, line 2: expected \{\"prompt\".*got \['answer', 'question'\]\. Rename the fields",
        ),
        (
            ['{"prompt": "hi", "response": "hello"}', '{"prompt": "one two three", "response": "four five six"}'],
            8,
            r"bad\.jsonl, line 2: the sample is 10 tokens long, longer than block_size=8\. Raise --data\.block_size",
        ),
    ],
    ids=["empty", "not-json", "missing-fields", "too-long"],
)
def test_bad_jsonl_is_one_line_naming_file_line_and_fix(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, lines: list[str], block_size: int, expected: str
) -> None:
    path = _write_jsonl(tmp_path / ("empty.jsonl" if not lines else "bad.jsonl"), lines)
    with pytest.raises(DataError, match=expected) as raised:
        _datamodule(path, model_dir, block_size=block_size)
    assert "\n" not in str(raised.value)


def test_empty_text_file_names_the_file(tmp_path: pathlib.Path, model_dir: pathlib.Path) -> None:
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha beta\n")
    (folder / "b.txt").write_text("  \n")
    with pytest.raises(DataError, match=r"b\.txt, line 1: the file is empty\. Fill it or remove it"):
        _datamodule(folder, model_dir)


# ---------------------------------------------------------------------------------------------- fit under ZenFlow


def test_zenflow_fit_exports_a_folder_that_reloads_with_the_validation_loss(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words = WORDS[:12]
    records = [{"prompt": f"{words[i % 12]} {words[(i + 1) % 12]}", "response": words[(i + 3) % 12]} for i in range(10)]
    datamodule = CausalLMDataModule(
        str(_write_jsonl(tmp_path / "train.jsonl", records)), str(model_dir), block_size=32, batch_size=2
    )  # val_fraction 0.05 of 10 records: the last one is held out
    export_dir = tmp_path / "export"
    module = CausalLMFineTune(
        str(model_dir), lr=1e-2, warmup_steps=1, export_dir=str(export_dir), sample_prompt="hi there", sample_tokens=3
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=ZenFlowStrategy(topk_ratio=0.25, update_interval=2, full_warm_up_rounds=1),
        max_steps=5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=datamodule)
    output = capsys.readouterr().out
    assert "sample: 'hi there' -> " in output
    assert isinstance(module.last_sample, str)

    (metrics,) = trainer.validate(module, datamodule=datamodule, verbose=False)
    assert metrics["val_ppl"] == pytest.approx(torch.exp(torch.tensor(metrics["val_loss"])).item(), rel=1e-6)

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    assert mean_loss(reloaded, datamodule.val_dataloader()) == pytest.approx(metrics["val_loss"], abs=1e-5)
    # the held-out loss printed after fit is the export's
    assert module.final_val_loss == pytest.approx(metrics["val_loss"], abs=1e-5)
    assert f"held-out loss of the final weights: {module.final_val_loss:.4f}" in output
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert abs(mean_loss(original, datamodule.val_dataloader()) - metrics["val_loss"]) > 1e-3  # it trained

    assert reloaded.config.tie_word_embeddings
    output_weight = reloaded.get_output_embeddings().weight
    assert output_weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    assert tokenizer.eos_token == "<eos>"
    assert tokenizer.chat_template == CHAT_TEMPLATE


# ------------------------------------------------------------------------------------------------------ the CLI

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "llm.md"


def _documented_command() -> list[str]:
    """The ``lightning-zenflow fit`` command of docs/llm.md, as arguments."""
    text = DOCS.read_text()
    start = text.index("lightning-zenflow fit --trainer.strategy zenflow")
    return shlex.split(text[start : text.index("```", start)].replace("\\\n", " "))


def test_the_documented_command_fits_and_exports(tmp_path: pathlib.Path, model_dir: pathlib.Path) -> None:
    records = [{"prompt": "hi there", "response": "hello friend"}, {"prompt": "one", "response": "two"}] * 3
    data_path = _write_jsonl(tmp_path / "train.jsonl", records)
    paths = {"path/to/model": model_dir, "path/to/finetuned": tmp_path / "export", "path/to/train.jsonl": data_path}
    command = [str(paths.get(arg, arg)) for arg in _documented_command()]
    short_run = ["--trainer.max_steps=2", "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.logger=false"]
    short_run += ["--trainer.enable_checkpointing=false", "--trainer.enable_progress_bar=false", "--data.batch_size=2"]
    short_run += [f"--trainer.default_root_dir={tmp_path}"]
    assert main([*command[1:], *short_run]) == 0
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export").config.tie_word_embeddings


@pytest.mark.parametrize("missing_option", ["--data.data_path", "--data.tokenizer_path", "--model.model_path"])
def test_a_missing_path_is_one_line_and_exit_status_2(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str], missing_option: str
) -> None:
    data_path = _write_jsonl(tmp_path / "train.jsonl", [{"prompt": "hi", "response": "hello"}] * 2)
    paths = {"path/to/model": model_dir, "path/to/finetuned": tmp_path / "export", "path/to/train.jsonl": data_path}
    command = [str(paths.get(arg, arg)) for arg in _documented_command()]
    missing = tmp_path / "missing"
    command[command.index(missing_option) + 1] = str(missing)
    assert main(command[1:]) == 2
    *_, error, tip = capsys.readouterr().err.strip().splitlines()  # before them: the model's loading progress bar
    assert error.startswith(f"error: {missing_option.rpartition('.')[2]} '{missing}' ")
    assert f"({missing_option})" in error  # the option to fix
    assert tip.startswith("tip: ")


def test_bad_data_from_the_command_line_is_one_line_and_exit_status_2(
    tmp_path: pathlib.Path, model_dir: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Bad data is found by the datamodule's setup, before training: the console script prints its one line."""
    data_path = tmp_path / "train.jsonl"
    data_path.write_text('{"prompt": "hi", "response": "hello"}\nnot json\n')
    paths = {"path/to/model": model_dir, "path/to/finetuned": tmp_path / "export", "path/to/train.jsonl": data_path}
    command = [str(paths.get(arg, arg)) for arg in _documented_command()]
    assert main(command[1:]) == 2
    *_, error, tip = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("error: ")
    assert "train.jsonl, line 2" in error
    assert tip.startswith("tip: ")
    assert not (tmp_path / "export").exists()
