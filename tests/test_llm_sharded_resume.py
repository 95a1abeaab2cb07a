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

transformers = pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_children")]


def test_a_sharded_checkpoint_resumes_the_sharded_load_exactly(tmp_path: pathlib.Path) -> None:
    """Also ``export_on_checkpoint`` beside a sharded checkpoint: the ``step-5`` folder (written a tensor at a time)
    holds the weights of the step-5 checkpoint directory, bitwise."""
    common = common_options(tmp_path)
    every = {**common, "strategy": "zenflow_fsdp", "devices": 2, "batch_size": 1, "max_steps": RESUME_STEPS}
    every["knobs"] = {**RESUME_KNOBS, "checkpoint_format": "sharded"}
    checkpoint = tmp_path / "checkpointed" / "ckpt" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt"
    fits = {
        "checkpointed": {**every, "checkpoint_every": CHECKPOINT_EVERY, "module": {"export_on_checkpoint": True}},
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

    # the export at the step-5 checkpoint: the checkpoint's weights (the directory converted to one file here)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp_path / "step5.pt")
    saved = torch.load(tmp_path / "step5.pt", weights_only=False)["model"]
    export_dir = tmp_path / "checkpointed" / "export"
    assert sorted(path.name for path in export_dir.iterdir() if path.is_dir()) == ["step-10", "step-5"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir / "step-5", dtype=torch.float32)
    assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[f"model.{name}"]), name
    final = results["checkpointed"][0]["weights"]["model.embed_tokens.weight"]
    assert not torch.equal(exported.state_dict()["model.embed_tokens.weight"], final)  # step 5, not the end
