"""Byte-level text data for the demo language model: any text file or folder, or the Python standard library.

Tokens are raw bytes (vocabulary 256), so there is no tokenizer to download and every machine that runs Python can
train on the same corpus offline: by default the standard library's own ``.py`` sources, or one of the two corpora
of :mod:`lightning_zenflow.demo.stdlib` (its code without docstrings, its documentation prose).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sysconfig
from collections.abc import Iterator
from typing import Literal

import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, Dataset, Sampler

from lightning_zenflow.demo.stdlib import STDLIB_TEXTS, StdlibText, stdlib_documents

VOCAB_SIZE = 256
"""Byte-level tokens: every byte value is a token."""

FILE_SEPARATOR = b"\n\n"
"""Bytes placed between two files when they are joined into one corpus."""

_EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
"""Parts of the standard library left out of the default corpus: third-party packages, the test suites (large,
repetitive and full of odd byte strings) and two packages that are GUI or deprecated tooling."""


def default_corpus_files() -> list[pathlib.Path]:
    """The Python standard library's ``.py`` files, sorted so that every run reads them in the same order.

    Raises:
        FileNotFoundError: this Python ships without its library sources (some slim images do).
    """
    stdlib_root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files: list[pathlib.Path] = []
    # os.walk, not rglob: pruning site-packages before descending saves seconds where it holds large packages.
    for folder, subfolders, file_names in os.walk(stdlib_root):
        subfolders[:] = [name for name in subfolders if name not in _EXCLUDED_STDLIB_DIRS]
        files.extend(pathlib.Path(folder, name) for name in file_names if name.endswith(".py"))
    if not files:
        raise FileNotFoundError(
            f"Found no .py sources in the standard library at {stdlib_root} (this Python ships without them). "
            "Pass data_path=... (a text file or a folder of text files), e.g. `--data.data_path path/to/text`."
        )
    return sorted(files)


def _read_text_bytes(path: pathlib.Path) -> bytes | None:
    """The bytes of ``path`` if it is UTF-8 text; ``None`` if it is unreadable, binary (holds NUL) or not UTF-8."""
    try:
        raw = path.read_bytes()
    except OSError:  # a permission-denied file or a dangling link in a user's folder is skipped, not fatal
        return None
    if b"\x00" in raw:
        return None
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return raw


def _is_hidden(path: pathlib.Path, root: pathlib.Path) -> bool:
    """Whether ``path`` or a folder between it and ``root`` is hidden (``.git``, ``.venv``, ...)."""
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _corpus_files(data_path: str | None) -> list[pathlib.Path]:
    """The files a corpus is read from, in reading order (see :func:`load_corpus_bytes`)."""
    if data_path is None:
        return default_corpus_files()
    root = pathlib.Path(data_path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"data_path={data_path!r} does not exist. Pass data_path=... a text file or a folder of text files, "
            "or leave it unset to train on the Python standard library's sources."
        )
    if root.is_file():
        if _read_text_bytes(root) is None:
            raise ValueError(
                f"data_path={data_path!r} is not a readable UTF-8 text file (it is binary, in another encoding, or "
                "unreadable). Pass data_path=... a UTF-8 text file or a folder of them."
            )
        return [root]
    return sorted(path for path in root.rglob("*") if path.is_file() and not _is_hidden(path, root))


def load_corpus_bytes(data_path: str | None, max_bytes: int, stdlib_text: StdlibText = "source") -> torch.Tensor:
    """Read a corpus as one flat ``uint8`` tensor of byte tokens (vocabulary 256), at most ``max_bytes`` long.

    Args:
        data_path: a text file; a folder, whose UTF-8 text files are all read (recursively, in sorted order;
            binary and non-UTF-8 files and hidden files and folders are skipped); or ``None`` for the Python
            standard library (see :func:`default_corpus_files`).
        max_bytes: stop reading once the corpus holds this many bytes; the last document read is cut.
        stdlib_text: with ``data_path=None``, which text of the standard library: ``"source"`` (the ``.py`` files
            whole), ``"code"`` (without docstrings) or ``"docs"`` (docstrings and the language reference); see
            :mod:`lightning_zenflow.demo.stdlib`. Ignored when ``data_path`` is given.

    Documents (files) are joined with :data:`FILE_SEPARATOR` between them.

    Raises:
        ValueError: ``max_bytes`` is not positive, the file is not UTF-8 text, or the folder holds no UTF-8 text.
        FileNotFoundError: ``data_path`` does not exist.
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes} must be positive; it caps how many bytes of text are read.")
    if stdlib_text not in STDLIB_TEXTS:
        raise ValueError(f"stdlib_text={stdlib_text!r} must be one of {', '.join(map(repr, STDLIB_TEXTS))}.")
    files = _corpus_files(data_path)
    if data_path is None:
        documents = stdlib_documents(files, stdlib_text)
    else:
        documents = (_read_text_bytes(path) for path in files)

    chunks: list[bytes] = []
    num_bytes = 0
    num_skipped = 0
    for text_bytes in documents:
        if num_bytes >= max_bytes:
            break
        if text_bytes is None or not text_bytes:
            num_skipped += 1
            continue
        if chunks:
            chunks.append(FILE_SEPARATOR)
            num_bytes += len(FILE_SEPARATOR)
        chunks.append(text_bytes)
        num_bytes += len(text_bytes)
    if not chunks:
        raise ValueError(
            f"data_path={data_path!r} holds no readable UTF-8 text files ({num_skipped} files skipped as unreadable, "
            "binary, empty or not UTF-8). Pass data_path=... a text file or a folder that contains text files."
        )
    # bytearray, not bytes: torch.frombuffer wants a writable buffer and the tensor then owns a private copy.
    corpus = bytearray(b"".join(chunks)[:max_bytes])
    return torch.frombuffer(corpus, dtype=torch.uint8)


def corpus_fingerprint(data_path: str | None, max_bytes: int, stdlib_text: StdlibText = "source") -> str:
    """A digest that changes when the corpus :func:`load_corpus_bytes` would read changes, without reading it.

    It covers the arguments and every file's path, size and modification time (``stat`` only), so it costs
    milliseconds where reading the standard library's code without its docstrings costs seconds. An edit that keeps a
    file's size and modification time is not seen.
    """
    digest = hashlib.sha256(json.dumps([data_path, max_bytes, stdlib_text if data_path is None else None]).encode())
    for path in _corpus_files(data_path):
        try:
            stat = path.stat()
        except OSError:  # skipped by the reader too
            continue
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


class ByteBlockDataset(Dataset):
    """Windows of ``block_size + 1`` bytes from a flat corpus, returned as ``(x, y)`` with ``y`` = ``x`` shifted by one.

    Window ``i`` starts at byte ``i * stride``: ``stride=block_size`` gives non-overlapping blocks, ``stride=1``
    every possible offset.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int, stride: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"{tokens.numel()} bytes cannot fill one block of block_size + 1 = {block_size + 1}.")
        self.tokens = tokens
        self.block_size = block_size
        self.stride = stride

    def __len__(self) -> int:
        return (self.tokens.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.stride
        window = self.tokens[start : start + self.block_size + 1].long()
        return window[:-1], window[1:]


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed that differs for every ``(seed, epoch)`` pair (a plain ``seed + epoch`` would not)."""
    digest = hashlib.blake2b(f"{seed}:{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class EpochSeededSampler(Sampler[int]):
    """Dataset indices in an order fixed by ``(seed, epoch)``, so a rerun or a resumed run sees the same batches.

    With ``num_samples=None`` it yields a permutation of all indices; otherwise ``num_samples`` indices drawn with
    replacement. Lightning calls :meth:`set_epoch` at the start of every epoch (also through its distributed sampler
    wrapper), which is what makes each epoch's order differ.
    """

    def __init__(self, num_indices: int, num_samples: int | None, seed: int) -> None:
        self.num_indices = num_indices
        self.num_samples = num_samples
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the order of ``epoch``; called by Lightning before each epoch."""
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_indices if self.num_samples is None else self.num_samples

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(_epoch_seed(self.seed, self.epoch))
        if self.num_samples is None:
            indices = torch.randperm(self.num_indices, generator=generator)
        else:
            indices = torch.randint(0, self.num_indices, (self.num_samples,), generator=generator)
        return iter(indices.tolist())


class ByteCorpusDataModule(LightningDataModule):
    """Next-byte prediction batches from a text corpus, split into a train part and a contiguous validation tail.

    Each sample is ``(x, y)``: two ``long`` tensors of ``block_size`` bytes, ``y`` being ``x`` shifted by one.
    The validation bytes follow the training bytes in the corpus and never overlap them. There is no separate test
    split: the test and predict loaders serve the validation split.
    """

    vocab_size: int = VOCAB_SIZE
    """Byte-level tokens: the model's vocabulary must be (at least) this large."""

    def __init__(
        self,
        data_path: str | None = None,
        block_size: int = 128,
        batch_size: int = 16,
        max_bytes: int = 4_000_000,
        val_fraction: float = 0.05,
        part: Literal["all", "first_half", "second_half"] = "all",
        num_workers: int = 0,
        seed: int = 0,
        samples_per_epoch: int | None = None,
        stdlib_text: StdlibText = "source",
    ) -> None:
        """Configure the corpus; nothing is read until :meth:`setup`.

        Args:
            data_path: a UTF-8 text file, or a folder read recursively (binary files skipped). ``None`` trains on
                the Python standard library (``stdlib_text`` says which of its text), which every Python install
                carries (no download).
            block_size: bytes per sample (the model's context length).
            batch_size: samples per batch.
            max_bytes: read at most this many bytes of text (the whole corpus, before it is halved or split).
            val_fraction: share of the chosen part held out, from its end, for validation.
            part: which half of the loaded corpus to use: ``"all"``, ``"first_half"`` or ``"second_half"``
                (pre-train on one half, fine-tune on the other, and the two never share a byte).
            num_workers: DataLoader worker processes (0 loads in the training process).
            seed: seed of the training order; each epoch's order is fixed by ``(seed, epoch)``.
            samples_per_epoch: ``None``: an epoch visits every non-overlapping training block once, shuffled. An int:
                an epoch is that many blocks at random byte offsets (drawn with replacement).
            stdlib_text: with ``data_path=None``: ``"source"``, the ``.py`` files whole; ``"code"``, the same without
                their docstrings; ``"docs"``, the docstrings and the language reference text (the main job fine-tunes
                on it). Ignored when ``data_path`` is given.
        """
        super().__init__()
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be at least 1.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1.")
        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes} must be positive.")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(
                f"val_fraction={val_fraction} must be in (0, 1); to skip validation keep it small and pass "
                "`Trainer(limit_val_batches=0)`."
            )
        if part not in ("all", "first_half", "second_half"):
            raise ValueError(f"part={part!r} must be one of 'all', 'first_half', 'second_half'.")
        if stdlib_text not in STDLIB_TEXTS:
            raise ValueError(f"stdlib_text={stdlib_text!r} must be one of {', '.join(map(repr, STDLIB_TEXTS))}.")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be 0 or more.")
        if samples_per_epoch is not None and samples_per_epoch < batch_size:
            raise ValueError(
                f"samples_per_epoch={samples_per_epoch} gives no full batch of batch_size={batch_size}; "
                "raise samples_per_epoch or leave it None to cover the training split once per epoch."
            )
        self.save_hyperparameters()
        self.data_path = data_path
        self.block_size = block_size
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.val_fraction = val_fraction
        self.part = part
        self.num_workers = num_workers
        self.seed = seed
        self.samples_per_epoch = samples_per_epoch
        self.stdlib_text = stdlib_text
        self.train_tokens: torch.Tensor | None = None
        self.val_tokens: torch.Tensor | None = None

    def setup(self, stage: str | None = None) -> None:
        """Load the corpus once (later stages reuse it), pick the part and split it into train and validation."""
        if self.train_tokens is not None:
            return
        corpus = load_corpus_bytes(self.data_path, self.max_bytes, self.stdlib_text)
        half = corpus.numel() // 2
        part_tokens = {"all": corpus, "first_half": corpus[:half], "second_half": corpus[half:]}[self.part]
        num_train = int(part_tokens.numel() * (1.0 - self.val_fraction))
        train_tokens, val_tokens = part_tokens[:num_train], part_tokens[num_train:]
        min_split_bytes = self.block_size + 1
        if min(train_tokens.numel(), val_tokens.numel()) < min_split_bytes:
            raise ValueError(
                f"The corpus is too short for block_size={self.block_size}: part={self.part!r} of "
                f"{corpus.numel()} bytes gives a train split of {train_tokens.numel()} and a validation split of "
                f"{val_tokens.numel()} bytes, and each needs at least block_size + 1 = {min_split_bytes}. "
                "Give more text (data_path, max_bytes), a smaller block_size, or a different val_fraction."
            )
        train_blocks = (train_tokens.numel() - 1) // self.block_size
        if self.samples_per_epoch is None and train_blocks < self.batch_size:
            raise ValueError(
                f"The train split holds {train_blocks} blocks of block_size={self.block_size}, fewer than one batch "
                f"of batch_size={self.batch_size}. Give more text (data_path, max_bytes), or lower batch_size."
            )
        self.train_tokens, self.val_tokens = train_tokens, val_tokens

    def _require_setup(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.train_tokens is None or self.val_tokens is None:
            raise RuntimeError("ByteCorpusDataModule.setup() must run before its dataloaders are requested.")
        return self.train_tokens, self.val_tokens

    def train_dataloader(self) -> DataLoader:
        """Shuffled training blocks, full batches only so every step sees the same shape."""
        train_tokens, _ = self._require_setup()
        if self.samples_per_epoch is None:
            dataset = ByteBlockDataset(train_tokens, self.block_size, stride=self.block_size)
        else:
            dataset = ByteBlockDataset(train_tokens, self.block_size, stride=1)
        sampler = EpochSeededSampler(len(dataset), self.samples_per_epoch, self.seed)
        return self._loader(dataset, sampler=sampler, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        """Non-overlapping validation blocks in corpus order."""
        _, val_tokens = self._require_setup()
        return self._loader(ByteBlockDataset(val_tokens, self.block_size, stride=self.block_size))

    def test_dataloader(self) -> DataLoader:
        """The validation split (the corpus has no separate test split)."""
        return self.val_dataloader()

    def predict_dataloader(self) -> DataLoader:
        """The validation split, as ``(x, y)`` batches."""
        return self.val_dataloader()

    def _loader(self, dataset: Dataset, sampler: Sampler | None = None, drop_last: bool = False) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )
