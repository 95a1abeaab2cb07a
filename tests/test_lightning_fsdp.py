"""ZenFlow on FSDP2 under Lightning: ``Trainer(strategy="zenflow_fsdp", devices=N)`` on the CPU (gloo).

Every fit runs ``tests/ddp_script.py``'s fits with ``fsdp`` set (in ranks forked by ``tests/rank_zygote.py``; the
killed worker's fit as a script, through Lightning's launcher): the module (8 -> 24 -> 6, every row count split evenly
over 1, 2 and 3 ranks) applies ``fully_shard`` to each linear layer and then to itself in ``configure_model``, as
docs/distributed.md says. The one-process fits compared with it (``ZenFlowStrategy``, Lightning's AdamW) run the same
script's ``fit`` in this process. Covered: the exact settings equal Lightning's ModelParallelStrategy with torch AdamW
(also clipped by norm: the global norm of the shards);
2 ranks equal one process on the same global batch (selection is global); each rank's device bytes (weights,
gradients, ZenFlow's state) and host bytes fall as 1/W; full and sharded (the default) checkpoints written at 2 ranks
resume at 1 and 3 ranks as the rest of the run, and the full one under plain AdamW and ZenFlowStrategy; a killed
worker on rank 1 ends both ranks; FSDP1, unsharded models and ``CPUOffloadPolicy`` are refused with the fix named.
The interim moves are on (``"auto"``) in these fits: 2 ranks equal one process with them, and differ from 2 ranks
without them. HSDP and 4 ranks: ``tests/test_lightning_hsdp.py``.
"""

from __future__ import annotations

import pathlib
import time

import pytest
import test_lightning_ddp
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_helpers import assert_weights_close, assert_weights_equal
from memory_probe import assert_holds_what_it_counts
from rank_zygote import Zygote
from test_lightning_ddp import assert_nothing_left, run_script

KNOBS = {"topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step", "select_interval": 4}
GLOBAL_BATCH = 12
"""Samples per step over all ranks: 12 at 1 rank, 6 per rank at 2, 4 per rank at 3 (48 samples, 4 steps/epoch)."""


def _options(devices: int, fsdp: bool = True, **options: object) -> dict:
    options = {"devices": devices, "samples": 48, "batch_size": GLOBAL_BATCH // devices, **options}
    options["fsdp" if fsdp else "wide"] = True
    return options


class Fits(test_lightning_ddp.Fits):
    """The data-parallel tests' fits (FSDP2 fits run as scripts, batched per number of ranks), keyed by
    :func:`_options`; :meth:`get` also returns the directory the fit wrote."""

    def get(self, devices: int, fsdp: bool = True, **options: object) -> tuple[pathlib.Path, list[dict]]:  # type: ignore[override]
        options = _options(devices, fsdp, **options)
        return self.dir(**options), super().get(**options)


CHECKPOINTED = {"strategy": {**KNOBS, "checkpoint_format": "full"}, "checkpoint_every": 4}
"""A fit with ``"full"`` checkpoints (one ``.ckpt`` file gathered to rank 0; ``"sharded"`` is the default)."""
SHARDED = {"strategy": {**KNOBS, "checkpoint_format": "sharded"}, "checkpoint_every": 4, "save_after": True}


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Fits:
    fits = Fits(tmp_path_factory.mktemp("fsdp_fits"))
    saved = {name: fits.dir(**_options(2, **run)) for name, run in (("full", CHECKPOINTED), ("sharded", SHARDED))}
    s1 = {**KNOBS, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}
    fits.plan(  # one launch per number of ranks: 2 first (the others resume its checkpoints), then 1 and 3
        *(_options(2, strategy=knobs) for knobs in ({"topk_ratio": 1.0}, s1, "adamw")),
        *(_options(2, strategy=knobs, gradient_clip_val=0.05) for knobs in (s1, "adamw")),
        _options(2, strategy={**KNOBS, "interim_step": 0}),
        _options(2, **CHECKPOINTED),
        _options(2, **SHARDED),
        *(_options(world, strategy=KNOBS) for world in (1, 3)),
        *(_options(world, strategy=KNOBS, ckpt_path=str(saved["full"] / "step=4.ckpt")) for world in (1, 3)),
        *(
            _options(world, strategy=SHARDED["strategy"], ckpt_path=str(saved["sharded"] / "step=4.ckpt"))
            for world in (1, 3)
        ),
        _options(1, strategy=SHARDED["strategy"], ckpt_path=str(saved["sharded"] / "after.ckpt")),
    )
    return fits


@pytest.mark.parametrize(
    "exact",
    [{"topk_ratio": 1.0}, {**KNOBS, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}],
    ids=["all_columns", "S1"],
)
def test_exact_settings_equal_model_parallel_adamw(fits: Fits, exact: dict) -> None:
    _, zenflow = fits.get(2, strategy=exact)
    _, adamw = fits.get(2, strategy="adamw")
    assert [r["strategy"] for r in zenflow] == ["ZenFlowFSDPStrategy"] * 2
    assert [r["strategy"] for r in adamw] == ["ModelParallelStrategy"] * 2
    assert zenflow[0]["global_step"] == adamw[0]["global_step"] == 8
    assert_weights_close(zenflow[0]["weights"], adamw[0]["weights"], atol=1e-6, rtol=0.0)
    assert_weights_equal(zenflow[1]["weights"], zenflow[0]["weights"])  # both ranks gathered the same model


def test_clipping_by_norm_takes_the_global_norm_of_the_shards(fits: Fits) -> None:
    # a threshold every step's gradient norm exceeds: a norm over one rank's shard only would clip differently
    exact = {**KNOBS, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}
    _, zenflow = fits.get(2, strategy=exact, gradient_clip_val=0.05)
    _, adamw = fits.get(2, strategy="adamw", gradient_clip_val=0.05)
    _, unclipped = fits.get(2, strategy="adamw")
    _, one = fits.get(1, fsdp=False, strategy=exact, gradient_clip_val=0.05)
    assert_weights_close(zenflow[0]["weights"], adamw[0]["weights"], atol=1e-6, rtol=0.0)
    assert_weights_close(zenflow[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)  # one process: one norm
    differs = max(
        (adamw[0]["weights"][k] - unclipped[0]["weights"][k]).abs().max().item() for k in unclipped[0]["weights"]
    )
    assert differs > 1e-4, f"the threshold did not clip (weights moved by {differs:.1e} at most)"


def test_two_ranks_equal_one_process_on_the_global_batch(fits: Fits) -> None:
    # one all-reduce of the column scores: both ranks choose what one process chooses from the whole gradient; one
    # all-reduce of the rows' and columns' sums per window: both hold the interim moves' statistics one process holds
    run, two = fits.get(2, **CHECKPOINTED)
    _, one = fits.get(1, fsdp=False, strategy=KNOBS)
    assert one[0]["strategy"] == "ZenFlowStrategy"
    assert two[0]["global_step"] == one[0]["global_step"] == 8
    assert_weights_close(two[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)
    # the moves are on in both (a test that they run on the shards, not that they are off everywhere)
    _, without = fits.get(2, strategy={**KNOBS, "interim_step": 0})
    moved = max((two[0]["weights"][k] - without[0]["weights"][k]).abs().max().item() for k in without[0]["weights"])
    assert moved > 1e-4, f"the interim moves changed the weights by {moved:.1e} at most"


def test_device_and_host_bytes_per_rank_fall_as_one_over_w(fits: Fits) -> None:
    by_world = {1: fits.get(1, strategy=KNOBS)[1], 2: fits.get(2, **CHECKPOINTED)[1]}
    by_world[3] = fits.get(3, strategy=KNOBS)[1]
    whole = by_world[1][0]
    for world, ranks in by_world.items():
        for result in ranks:
            for kind in ("weights", "gradients"):  # the row blocks split evenly: exactly 1/W
                assert result["device_bytes"][kind] * world == whole["device_bytes"][kind], (world, kind)
    # ZenFlow's device state and the host state: a part that is split by rows (exactly 1/W here) and a small part
    # every rank keeps whole (per column: the selected indices, the scores, the rounding's column numbers: up to a
    # third of these tiny matrices' compact state, far less of a real model's); 1 and 2 ranks fix both, 3 must follow
    for kind in ("zenflow", "host"):
        at = {world: _bytes(ranks[0], kind) for world, ranks in by_world.items()}
        kept = 2 * at[2] - at[1]
        assert 0 <= kept < 0.4 * at[1], (kind, at)
        assert at[3] == (at[1] - kept) / 3 + kept, (kind, at)
        assert all(_bytes(result, kind) == at[world] for world, ranks in by_world.items() for result in ranks)


def test_each_rank_holds_what_it_counts(fits: Fits) -> None:
    """Per rank of the 1-, 2- and 3-rank fits: the engine's bytes equal ``engine/budget.py``'s formulas for its shards
    and the shared memory the rank maps and its worker holds is what it counts (tests/memory_probe.py)."""
    by_world = {1: fits.get(1, strategy=KNOBS)[1], 2: fits.get(2, **CHECKPOINTED)[1]}
    by_world[3] = fits.get(3, strategy=KNOBS)[1]
    for ranks in by_world.values():
        for result in ranks:
            assert_holds_what_it_counts(result["memory"])
    elements = {world: sum(result["memory"]["elements"] for result in ranks) for world, ranks in by_world.items()}
    assert elements[2] == elements[3] == elements[1]  # the shards' host rows cover the model once per machine


def _bytes(result: dict, kind: str) -> int:
    return result["host_bytes"] if kind == "host" else result["device_bytes"][kind]


def test_a_full_checkpoint_at_two_ranks_resumes_at_one_and_three_and_under_the_other_optimizers(fits: Fits) -> None:
    run, two = fits.get(2, **CHECKPOINTED)
    saved = run / "step=4.ckpt"
    assert saved.is_file()  # one file, gathered to rank 0
    for world in (1, 3):
        _, resumed = fits.get(world, strategy=KNOBS, ckpt_path=str(saved))
        assert resumed[0]["global_step"] == 8
        assert_weights_close(resumed[0]["weights"], two[0]["weights"], atol=1e-6, rtol=1e-5)
    # the other strategies read it as their own: ZenFlowStrategy as the rest of the run, plain AdamW as AdamW
    _, single = fits.get(1, fsdp=False, strategy=KNOBS, ckpt_path=str(saved))
    assert single[0]["global_step"] == 8
    assert_weights_close(single[0]["weights"], two[0]["weights"], atol=1e-6, rtol=1e-5)
    _, plain = fits.get(1, fsdp=False, strategy="adamw", ckpt_path=str(saved))
    assert plain[0]["global_step"] == 8
    assert plain[0]["strategy"] == "SingleDeviceStrategy"


def test_a_sharded_checkpoint_at_two_ranks_resumes_at_one_and_three(fits: Fits) -> None:
    knobs = SHARDED["strategy"]
    run, two = fits.get(2, **SHARDED)
    saved = run / "step=4.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    _, uninterrupted = fits.get(2, **CHECKPOINTED)
    assert_weights_equal(two[0]["weights"], uninterrupted[0]["weights"])  # the format does not change the run
    for world in (1, 3):
        _, resumed = fits.get(world, strategy=knobs, ckpt_path=str(saved))
        assert resumed[0]["global_step"] == 8
        assert_weights_close(resumed[0]["weights"], two[0]["weights"], atol=1e-6, rtol=1e-5)
    # saved after the fit (the engine closed, its row blocks kept): resumes with the final weights
    _, after = fits.get(1, strategy=knobs, ckpt_path=str(run / "after.ckpt"))
    assert after[0]["global_step"] == 8
    assert_weights_equal(after[0]["weights"], two[0]["weights"])


def test_a_killed_worker_on_rank_one_ends_both_ranks(tmp_path: pathlib.Path) -> None:
    started = time.monotonic()
    done = run_script(tmp_path, devices=2, fsdp=True, strategy=KNOBS, max_steps=400, fault_rank=1, kill_worker_at=3)
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert "host worker" in done.stderr
    assert "signal 9" in done.stderr
    assert not (tmp_path / "rank0.pt").exists()
    assert_nothing_left(tmp_path)
    assert elapsed < 200  # far below the 400 steps; the collective timeout here is 60 s


@pytest.mark.parametrize(
    ("shard", "message"),
    [
        ("none", "is not sharded by FSDP2; apply fully_shard"),
        ("offload", "Remove offload_policy from fully_shard"),
        ("fsdp1", "only supports the new FSDP2 APIs"),  # Lightning's own check
    ],
)
def test_a_model_zenflow_cannot_shard_is_refused_with_the_fix(tmp_path: pathlib.Path, shard: str, message: str) -> None:
    # the refusal comes at setup, as the process is launched (here forked as a cluster launcher starts a rank)
    done = Zygote.run(tmp_path, {"devices": 1, "fsdp": True, "shard": shard, "strategy": KNOBS}, world=1, timeout_s=120)
    assert done["codes"] == [1]
    assert message in pathlib.Path(done["logs"][0]).read_text()
    assert not (tmp_path / "rank0.pt").exists()


def test_interim_moves_are_taken_and_other_meshes_are_refused() -> None:
    import lightning_zenflow

    assert lightning_zenflow.ZenFlowFSDPStrategy(interim_step=0.5).zenflow_config.interim_step == 0.5
    assert lightning_zenflow.ZenFlowFSDPStrategy(interim_step=0).zenflow_config.interim_step == 0.0
    assert lightning_zenflow.ZenFlowFSDPStrategy().zenflow_config.interim_step == "auto"
    strategy = lightning_zenflow.ZenFlowFSDPStrategy(data_parallel_size=1)
    strategy.parallel_devices = [torch.device("cpu")] * 2  # what the trainer sets for devices=2
    with pytest.raises(MisconfigurationException, match="data_parallel_size='auto'"):
        strategy.setup_environment()
