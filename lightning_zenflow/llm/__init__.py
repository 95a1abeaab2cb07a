"""Fine-tuning of real Hugging Face causal LMs (needs ``pip install 'lightning-zenflow[llm]'``).

``transformers`` is imported only when a class here is built, so ``import lightning_zenflow.llm`` works without it.
"""

from lightning_zenflow.llm.data import CausalLMDataModule, DataError
from lightning_zenflow.llm.module import CausalLMFineTune

__all__ = ["CausalLMDataModule", "CausalLMFineTune", "DataError"]
