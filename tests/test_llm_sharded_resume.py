"""``CausalLMFineTune`` under ``zenflow_fsdp`` resumed from a sharded checkpoint (2 ranks, gloo; slow tier).

The resumed fit builds the model on meta and each rank reads its own rows of the weight files (``configure_model``
runs before Lightning restores the checkpoint), then the checkpoint's weights and ZenFlow state replace them: the fit
ends bitwise as the one that was not stopped, each rank on the rest of its own batches.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from test_llm_distributed import CHECKPOINT_EVERY, RESUME_KNOBS, RESUME_STEPS, common_options, launch

pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_children")]


def test_a_sharded_checkpoint_resumes_the_sharded_load_exactly(tmp_path: pathlib.Path) -> None:
    common = common_options(tmp_path)
    every = {**common, "strategy": "zenflow_fsdp", "devices": 2, "batch_size": 1, "max_steps": RESUME_STEPS}
    every["knobs"] = {**RESUME_KNOBS, "checkpoint_format": "sharded"}
    checkpoint = tmp_path / "checkpointed" / "ckpt" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt"
    fits = {
        "checkpointed": {**every, "checkpoint_every": CHECKPOINT_EVERY},
        "resumed": {**every, "ckpt_path": str(checkpoint)},
    }
    results = launch(tmp_path, fits)
    assert checkpoint.is_dir()  # a torch.distributed.checkpoint directory: every rank wrote its share
    for rank, (whole, rest) in enumerate(zip(results["checkpointed"], results["resumed"])):
        assert whole["sharded"]
        assert rest["sharded"]
        assert rest["tied"]
        assert whole["global_step"] == rest["global_step"] == RESUME_STEPS
        assert rest["batches"] == whole["batches"][CHECKPOINT_EVERY:], f"rank {rank} resumed on other batches"
        for name, tensor in whole["weights"].items():
            assert torch.equal(rest["weights"][name], tensor), f"rank {rank}: {name} differs after the resume"
