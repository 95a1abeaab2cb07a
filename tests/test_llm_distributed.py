"""lightning_zenflow.llm on 2 ranks (gloo, CPU): ``CausalLMFineTune`` on ``CausalLMDataModule`` text under
``zenflow_ddp`` and ``zenflow_fsdp`` (the module shards the Hugging Face model in ``configure_model``: every decoder
layer, then the whole model), with validation and an export; a resume mid-epoch, activation checkpointing and the
export at every checkpoint.

The model is a tiny random Llama with tied embeddings (tests/llm_helpers.py); the data one text file packed into 28
blocks of 16 tokens, 24 for training (6 steps of 2 blocks per rank) and 4 held out. The 2-rank fits run in two
launches of forked ranks (tests/rank_zygote.py, ``llm_helpers.fit`` in each, one fit after another): the fits of both
strategies, then the one-process ``zenflow`` fit they are compared with in this process, on the global batches the
ranks trained on (recorded, and replayed in order); and the fits with checkpoints.
Covered: both ranks finish every fit, together training on every block once; the export exists, reloads with
``from_pretrained``, keeps its embeddings tied, equals the run's final weights and has the run's last ``val_loss`` as
its held-out loss; rank 0 alone generates the sample, the export's greedy continuation; 2 ranks equal one process on
the global batches (the last ``val_loss`` to 1e-5; the weights to the data-parallel tests' tolerance, but for a few
of near-zero gradient, which Adam's step leaves within 6e-4: :func:`assert_close_up_to_adam_rounding`).
Under ``zenflow_fsdp`` each rank reads only its own rows of the weight files and the export is written a tensor at
a time (``tests/test_llm_sharded_load.py`` tests both alone); the same fit with every rank reading the whole model
first (``load_weights="now"``) ends bitwise equal. Also covered: ``zenflow_ddp`` resumed from a checkpoint inside
its epoch and inside a host window ends bitwise as the uninterrupted fit, each rank on the rest of its own batches;
``zenflow_fsdp`` with ``activation_checkpointing`` recomputes every layer and trains as without it (to 1e-6), and with
``export_on_checkpoint`` every ``step-N`` folder holds its checkpoint's full weights, tied, and the final folder the
final weights.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from lightning_helpers import assert_weights_equal
from llm_helpers import fit, mean_loss, save_tiny_llama, write_text
from rank_zygote import Zygote

from lightning_zenflow.llm import CausalLMDataModule
from lightning_zenflow.llm.module import generate_sample
from lightning_zenflow.llm.sharding import shard_blocks

transformers = pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")
pytest.importorskip("tokenizers", reason="the test tokenizer is built with `tokenizers`")

pytestmark = pytest.mark.usefixtures("no_leaked_children")

KNOBS = {
    "topk_ratio": 0.25,
    "update_interval": 2,  # windows end at steps 2, 4 and 6; each lands at the next window end
    "select_strategy": "step",
    "select_interval": 3,  # selections at steps 1 and 4
    "sync_on": ["validation"],  # the update of the last window, in flight at the end, lands before the validation
}
PER_RANK_BATCH, STEPS = 2, 6
BLOCK_SIZE, TRAIN_BLOCKS, VAL_BLOCKS = 16, STEPS * 2 * PER_RANK_BATCH, 4
VAL_FRACTION = VAL_BLOCKS / (TRAIN_BLOCKS + VAL_BLOCKS)
STRATEGIES = ("zenflow_ddp", "zenflow_fsdp")
PROMPT = "hi there"
LR = 1e-2
"""``CausalLMFineTune``'s peak learning rate (1 step of warm-up, then cosine to 10 %)."""
ADAM_ROUNDING = STEPS * LR * 1e-2
"""How far a weight of the 2-rank fits may be from the one-process fit's: see
:func:`assert_close_up_to_adam_rounding`."""

RESUME_KNOBS = {**KNOBS, "update_interval": 4, "select_interval": 8}
"""Windows of 4 steps: the checkpoint at step 5 lands one step into the second window, the first window's host update
still in flight; the one at step 10 two steps into the third."""
RESUME_STEPS, CHECKPOINT_EVERY = 2 * STEPS, 5
"""The resumed fit's whole epoch, 1 block a rank a step; a checkpoint every 5 steps (5 and 10), not at a window end."""
RECOMPUTE_ATOL = 1e-6
"""How far activation checkpointing may move a trained weight (it measures none): see
:func:`test_two_ranks_fsdp_recompute_and_export_every_checkpoint`."""


def common_options(root: pathlib.Path) -> dict:
    """The tiny model and the text file, written into ``root``, and the options every fit of the module shares."""
    return {
        "entry": "llm_helpers:fit",
        "model_dir": str(save_tiny_llama(root / "model")),
        "data_path": str(write_text(root / "corpus.txt", TRAIN_BLOCKS + VAL_BLOCKS, BLOCK_SIZE)),
        "block_size": BLOCK_SIZE,
        "val_fraction": VAL_FRACTION,
        "max_steps": STEPS,
        "lr": LR,
        "knobs": KNOBS,
    }


def launch(root: pathlib.Path, fits: dict[str, dict]) -> dict[str, list[dict]]:
    """The 2-rank ``fits`` in one launch, one after another in the same ranks; each one's results, by rank."""
    done = Zygote.run(
        root / "launch",
        {"batch": [[str(root / name), options] for name, options in fits.items()]},
        world=2,
        timeout_s=240.0,
    )
    logs = "\n".join(pathlib.Path(log).read_text()[-4000:] for log in done["logs"])
    assert done["codes"] == [0, 0], logs
    return {name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(2)] for name in fits}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fits of both strategies, once: the 2-rank fits in one launch, then the one-process fit here."""
    root = tmp_path_factory.mktemp("llm_fits")
    common = common_options(root)
    two = {
        name: {**common, "strategy": name, "devices": 2, "batch_size": PER_RANK_BATCH, "sample_prompt": PROMPT}
        for name in STRATEGIES
    }
    # the path before sharded loading: every rank reads the whole model at construction, then shards it
    two["fsdp_read_whole"] = {**two["zenflow_fsdp"], "module": {"load_weights": "now"}, "sample_prompt": None}
    results = launch(root, two)
    # one process on the global batches of the 2 ranks (both strategies' ranks trained on the same ones)
    ranks = results[STRATEGIES[0]]
    replay = [ranks[0]["batches"][step] + ranks[1]["batches"][step] for step in range(STEPS)]
    one = {**common, "strategy": "zenflow", "devices": 1, "batch_size": 2 * PER_RANK_BATCH, "replay": replay}
    (root / "zenflow").mkdir()
    results["zenflow"] = [fit(root / "zenflow", one)]
    model_dir, data_path = common["model_dir"], common["data_path"]
    datamodule = CausalLMDataModule(
        data_path, model_dir, block_size=BLOCK_SIZE, batch_size=2, val_fraction=VAL_FRACTION
    )
    datamodule.setup("fit")
    return {"root": root, "model_dir": pathlib.Path(model_dir), "results": results, "datamodule": datamodule}


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The fits with checkpoints, in one launch (a fixture of their own: pytest-xdist may run their tests in another
    process than the ones of :func:`runs`, which then does not fit those again)."""
    root = tmp_path_factory.mktemp("llm_checkpointed")
    common = common_options(root)
    # a zenflow_ddp fit with checkpoints mid-epoch and mid-window, then one resumed from its step-5 checkpoint
    every = {**common, "strategy": "zenflow_ddp", "devices": 2, "batch_size": 1, "max_steps": RESUME_STEPS}
    every["knobs"] = RESUME_KNOBS
    fits = {
        "ddp_checkpointed": {**every, "checkpoint_every": CHECKPOINT_EVERY},
        "ddp_resumed": {
            **every,
            "ckpt_path": str(root / "ddp_checkpointed" / "ckpt" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt"),
        },
    }
    # zenflow_fsdp exporting at every checkpoint (steps 3 and 6), with and without recomputing the activations
    fsdp = {**common, "strategy": "zenflow_fsdp", "devices": 2, "batch_size": PER_RANK_BATCH, "checkpoint_every": 3}
    fsdp["knobs"] = {**KNOBS, "checkpoint_format": "full"}  # one .ckpt file, read whole below
    fits["fsdp_recompute"] = {**fsdp, "module": {"activation_checkpointing": True, "export_on_checkpoint": True}}
    fits["fsdp_plain"] = {**fsdp, "module": {"export_on_checkpoint": True}}
    return {"root": root, "model_dir": pathlib.Path(common["model_dir"]), "results": launch(root, fits)}


@pytest.mark.parametrize("name", STRATEGIES)
def test_two_ranks_fit_validate_and_export_a_folder_with_the_last_validation_loss(runs: dict, name: str) -> None:
    ranks = runs["results"][name]
    expected = {"zenflow_ddp": "ZenFlowDDPStrategy", "zenflow_fsdp": "ZenFlowFSDPStrategy"}[name]
    for rank in ranks:  # both ranks ran the whole fit, then the validation after its last step
        assert (rank["strategy"], rank["world_size"], rank["global_step"]) == (expected, 2, STEPS)
        assert [step for step, _ in rank["validations"]] == [STEPS]
        assert rank["sharded"] is (name == "zenflow_fsdp")  # configure_model shards under zenflow_fsdp only
        assert rank["tied"]  # one embedding parameter, also as FSDP2 shards
    assert ranks[0]["validations"] == ranks[1]["validations"]  # one val_loss over both ranks' halves
    assert_weights_equal(ranks[1]["weights"], ranks[0]["weights"])  # replicas, or the same gathered shards
    # the epoch: each training block once, each step's global batch split between the ranks
    seen = sorted(row for rank in ranks for batch in rank["batches"] for row in batch)
    assert seen == sorted(sample["input_ids"] for sample in runs["datamodule"].train_samples)
    assert all(len(batch) == PER_RANK_BATCH for rank in ranks for batch in rank["batches"])

    export_dir = runs["root"] / name / "export"
    assert (export_dir / "config.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    assert reloaded.config.tie_word_embeddings
    assert reloaded.get_output_embeddings().weight.data_ptr() == reloaded.get_input_embeddings().weight.data_ptr()
    exported = {key: value.detach() for key, value in reloaded.named_parameters()}
    assert_weights_equal(exported, ranks[0]["weights"])  # the weights after the last update, gathered whole
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    assert tokenizer.eos_token == "<eos>"
    # the sample after fit: rank 0 alone generates, from the same weights (under FSDP2 a whole copy of them)
    assert ranks[1]["sample"] is None
    assert ranks[0]["sample"] == generate_sample(reloaded, tokenizer, PROMPT, 3)

    last_val_loss = ranks[0]["validations"][-1][1]
    loader = runs["datamodule"].val_dataloader()
    assert mean_loss(reloaded, loader) == pytest.approx(last_val_loss, abs=1e-5)
    original = transformers.AutoModelForCausalLM.from_pretrained(runs["model_dir"], dtype=torch.float32).eval()
    assert abs(mean_loss(original, loader) - last_val_loss) > 1e-3  # it trained


@pytest.mark.parametrize("name", STRATEGIES)
def test_two_ranks_equal_one_process_on_the_global_batches(runs: dict, name: str) -> None:
    ranks = runs["results"][name]
    (one,) = runs["results"]["zenflow"]
    assert one["strategy"] == "ZenFlowStrategy"
    assert one["global_step"] == STEPS
    assert [step for step, _ in one["validations"]] == [STEPS]
    assert not one["sharded"]
    assert one["tied"]
    for step in range(STEPS):  # the global batches of both strategies' ranks, which the one process replayed
        together = ranks[0]["batches"][step] + ranks[1]["batches"][step]
        assert together == one["batches"][step], step
    assert_close_up_to_adam_rounding(ranks[0]["weights"], one["weights"])
    assert ranks[0]["validations"][-1][1] == pytest.approx(one["validations"][-1][1], abs=1e-5)


def test_two_ranks_fsdp_reading_their_rows_train_as_reading_the_whole_model(runs: dict) -> None:
    """``zenflow_fsdp`` with each rank reading its own rows (the default) and with every rank reading the whole model
    at construction (``load_weights="now"``), then sharding it: the same fit, bitwise, and the same export."""
    sharded, whole = runs["results"]["zenflow_fsdp"], runs["results"]["fsdp_read_whole"]
    for rank_sharded, rank_whole in zip(sharded, whole):
        assert rank_whole["sharded"]
        assert rank_whole["tied"]
        assert rank_sharded["batches"] == rank_whole["batches"]
        assert rank_sharded["validations"] == rank_whole["validations"]
        assert rank_sharded["weights"].keys() == rank_whole["weights"].keys()
        for name, tensor in rank_whole["weights"].items():
            assert torch.equal(rank_sharded["weights"][name], tensor), name
    exported = {}
    for name in ("zenflow_fsdp", "fsdp_read_whole"):
        model = transformers.AutoModelForCausalLM.from_pretrained(runs["root"] / name / "export", dtype=torch.float32)
        exported[name] = model.state_dict()
    for name, tensor in exported["fsdp_read_whole"].items():
        assert torch.equal(exported["zenflow_fsdp"][name], tensor), name


def assert_close_up_to_adam_rounding(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Every weight to the data-parallel and FSDP2 tests' tolerance (atol 1e-6, rtol 1e-5) but at most one in a
    thousand, and those within ``ADAM_ROUNDING``: 1 % of the learning rate per step.

    The ranks average their halves' gradients where one process takes the mean over the whole batch: the sums round
    differently, by about 1e-9 here (7e-10 measured at the first step). Adam's step, ``lr * m / sqrt(v)``, does not
    scale with the gradient, so an element whose gradient is tiny (about 1e-6, where the contributions of the tokens
    cancel) carries that rounding as a relative error of 1e-3 or more into a step of up to ``lr``. Measured: one
    element of the model's 28096 off by 2e-5 to 4e-5, every other one within the tight tolerance. The compact host
    state (the default) rounds the window's sum and the second moment to bf16: a value within that rounding of a
    threshold rounds the other way, one bf16 step of a sum (measured: 32 of 28192 weights, within ``ADAM_ROUNDING``),
    so at most one in two hundred may differ. A fault of the rule (another selection, a gradient not averaged, a shard
    updated twice) moves whole columns by about ``lr``."""
    assert actual.keys() == expected.keys()
    loose, total = 0, 0
    for name, value in expected.items():
        difference = (actual[name] - value).abs()
        assert difference.max().item() <= ADAM_ROUNDING, f"{name} differs by {difference.max().item():.2e}"
        loose += int((difference > 1e-6 + 1e-5 * value.abs()).sum())
        total += value.numel()
    assert loose <= total // 200, f"{loose} of {total} weights differ by more than atol 1e-6, rtol 1e-5"


def test_a_model_without_blocks_to_shard_is_refused_with_the_fix() -> None:
    # configure_model under zenflow_fsdp shards the classes a Hugging Face model names in _no_split_modules
    with pytest.raises(ValueError, match=r"Linear names no blocks to shard.*Shard it in your own configure_model"):
        shard_blocks(torch.nn.Linear(2, 2), mesh=None)


def test_a_two_rank_resume_from_a_mid_epoch_mid_window_checkpoint_continues_exactly(checkpointed: dict) -> None:
    """Each rank resumes its own shard of the epoch at the checkpoint's batch (the loader's state is the loop's count,
    the same on every rank), and ZenFlow's engines inside their window: the weights bitwise as without the stop.

    ``llm_helpers.fit`` sets ``max_epochs``, so ``CausalLMFineTune``'s schedule (``estimated_stepping_batches``) has
    Lightning build the training loader before it restores the checkpoint: ``ResumableLoader`` loads its state at the
    first fetch then (without that, the resumed ranks started the epoch over and ended 2e-2 away)."""
    uninterrupted, resumed = checkpointed["results"]["ddp_checkpointed"], checkpointed["results"]["ddp_resumed"]
    checkpoints = sorted((checkpointed["root"] / "ddp_checkpointed" / "ckpt").glob("*.ckpt"))
    assert [path.name for path in checkpoints] == ["epoch=0-step=10.ckpt", "epoch=0-step=5.ckpt"]
    checkpoint = torch.load(checkpoints[1], weights_only=False)
    assert checkpoint["global_step"] == CHECKPOINT_EVERY
    loader_state = checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    assert loader_state == [{"epoch": 0, "batches": CHECKPOINT_EVERY}]  # rank 0's, which every rank loads
    for rank, (whole, rest) in enumerate(zip(uninterrupted, resumed)):
        assert whole["global_step"] == rest["global_step"] == RESUME_STEPS
        assert len(whole["batches"]) == RESUME_STEPS  # the whole epoch: 12 blocks a rank, one a step
        assert rest["batches"] == whole["batches"][CHECKPOINT_EVERY:], f"rank {rank} resumed on other batches"
        assert whole["weights"].keys() == rest["weights"].keys()
        for name, tensor in whole["weights"].items():
            assert torch.equal(rest["weights"][name], tensor), f"rank {rank}: {name} differs after the resume"
    assert_weights_equal(uninterrupted[1]["weights"], uninterrupted[0]["weights"])


def test_two_ranks_fsdp_recompute_and_export_every_checkpoint(checkpointed: dict) -> None:
    """``zenflow_fsdp`` with ``activation_checkpointing`` and ``export_on_checkpoint``: each ``step-N`` folder holds
    the weights of the step-N checkpoint (a full state dict, gathered to rank 0), tied; the folder at the end of fit
    the final weights.

    Recomputing a decoder layer in the backward pass repeats its forward, the same operations on the same inputs, so
    the gradients and the weights are those of the same fit without it (``fsdp_plain``, its exports included):
    measured, bitwise. ``RECOMPUTE_ATOL`` (1e-6, the one-process test's) leaves room for float32 rounding alone (about
    1e-7 of a weight); a recomputation on other inputs (a lost mask or rotary position, dropout drawn again) or an
    update gone wrong moves weights by about ``lr`` = 1e-2, four orders of magnitude more."""
    ranks, plain = checkpointed["results"]["fsdp_recompute"], checkpointed["results"]["fsdp_plain"]
    for rank in ranks:
        assert (rank["strategy"], rank["global_step"]) == ("ZenFlowFSDPStrategy", STEPS)
        assert [step for step, _ in rank["validations"]] == [STEPS]
        assert rank["sharded"]
        assert rank["tied"]
        assert rank["mlp_calls"] == 2 * STEPS  # every training forward of the first layer, and again in backward
    assert [rank["mlp_calls"] for rank in plain] == [STEPS, STEPS]
    assert_weights_equal(ranks[1]["weights"], ranks[0]["weights"])
    for name, tensor in plain[0]["weights"].items():
        torch.testing.assert_close(ranks[0]["weights"][name], tensor, rtol=0, atol=RECOMPUTE_ATOL, msg=name)

    folder = checkpointed["root"] / "fsdp_recompute"
    export_dir = folder / "export"
    assert sorted(path.name for path in export_dir.iterdir() if path.is_dir()) == ["step-3", "step-6"]
    model_dir = checkpointed["model_dir"]
    original = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    exports = {}
    for step in (3, 6):
        (checkpoint,) = (folder / "ckpt").glob(f"*step={step}.ckpt")
        saved = torch.load(checkpoint, weights_only=False)["state_dict"]
        exported = transformers.AutoModelForCausalLM.from_pretrained(export_dir / f"step-{step}", dtype=torch.float32)
        assert exported.get_output_embeddings().weight is exported.get_input_embeddings().weight
        exports[step] = exported.state_dict()
        assert {f"model.{name}" for name in exports[step]} == set(saved)
        for name, tensor in exports[step].items():
            whole = saved[f"model.{name}"]
            assert type(whole) is torch.Tensor, name  # not a DTensor
            assert whole.shape == original[name].shape, name  # whole, not this rank's rows
            assert torch.equal(tensor, whole), f"step-{step}: {name}"
        assert transformers.AutoTokenizer.from_pretrained(export_dir / f"step-{step}").eos_token == "<eos>"
    embeddings = "model.embed_tokens.weight"
    assert not torch.equal(exports[3][embeddings], original[embeddings])  # trained by step 3
    assert not torch.equal(exports[6][embeddings], exports[3][embeddings])  # and on
    final = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    assert final.get_output_embeddings().weight is final.get_input_embeddings().weight
    assert_weights_equal({key: value.detach() for key, value in final.named_parameters()}, ranks[0]["weights"])
