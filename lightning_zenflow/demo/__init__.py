"""Demo model and data for the examples, benchmarks and the main job: a small GPT trained on byte-level text.

``HFCausalLMModule`` is resolved on first access so that this package imports without ``transformers``.
"""

from typing import Any

from lightning_zenflow.demo.data import ByteCorpusDataModule, default_corpus_files, load_corpus_bytes
from lightning_zenflow.demo.model import GPT, CausalLMModule, GPTConfig

__all__ = [
    "GPT",
    "ByteCorpusDataModule",
    "CausalLMModule",
    "GPTConfig",
    "HFCausalLMModule",
    "default_corpus_files",
    "load_corpus_bytes",
]


def __getattr__(name: str) -> Any:
    # Lazy so that `import lightning_zenflow.demo` never pulls in the optional Hugging Face wrapper's dependencies.
    if name == "HFCausalLMModule":
        from lightning_zenflow.demo.hf import HFCausalLMModule

        return HFCausalLMModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
