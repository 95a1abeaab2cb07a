"""HSDP under ``zenflow_fsdp``: ``Trainer(num_nodes=N, devices=D, strategy=ZenFlowFSDPStrategy(shard_size=...))`` on
the CPU (gloo), and sharded checkpoints that resume at another number of ranks.

The "machines" are processes of this one: ``tests/rank_zygote.py`` forks the ranks and
``distributed_helpers.hsdp_fit`` gives each the environment a launcher gives the ``r``-th rank of ``N`` machines of
``D`` ranks (``NODE_RANK``, ``LOCAL_RANK``), so Lightning sees ``num_nodes=N`` and launches nothing. The module
(8 -> 24 -> 8: every row count splits over 1, 2 and 4 ranks) applies ``fully_shard`` on ``strategy.shard_mesh``.

Default suite: 2 machines of 1 rank (HSDP 2 x 1: a replica per machine) equal one process on the global batch, and
write a sharded checkpoint whose replicated blocks are written once; ``shard_size`` is checked. Slow tier (4 ranks):
HSDP 2 x 2 equals ``fully_shard`` on the same 2-D mesh with torch AdamW in the exact setting (also clipped by norm),
and one process on the global batch; a sharded checkpoint written at 4 ranks resumes at 2, and one written under
HSDP 2 x 2 resumes at 4 ranks of plain FSDP (and back), each as the rest of the uninterrupted run; the ``"full"``
file under HSDP; a module sharded on Lightning's 1-D mesh under HSDP is refused with the fix; two ``torchrun``
"machines" (static rendezvous) run HSDP 2 x 1 with nothing special; ``Ranks``' collectives (no Lightning) keep the
rows inside a shard group and agree over every rank.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_helpers import assert_weights_close, assert_weights_equal
from rank_zygote import Zygote

KNOBS = {"topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step", "select_interval": 4}
EXACT = {**KNOBS, "update_interval": 1, "overlap_step": False, "host_state": "fp32"}
GLOBAL_BATCH = 12
ENTRY = "distributed_helpers:hsdp_fit"


def launch(root: pathlib.Path, fits: dict[str, dict], world: int) -> dict[str, list[dict]]:
    """Run ``fits`` (name: options of ``hsdp_fit``) one after another in one launch of ``world`` ranks; each fit's
    per-rank results, by name."""
    batch = []
    for name, options in fits.items():
        devices, num_nodes = int(options.get("devices", 1)), int(options.get("num_nodes", 1))
        assert devices * num_nodes == world, name
        batch_size = GLOBAL_BATCH // world
        batch.append([str(root / name), {"entry": ENTRY, "batch_size": batch_size, **options}])
    out = root / f"launch-{'-'.join(fits)}"
    done = Zygote.run(out, {"batch": batch}, world=world, timeout_s=120.0 + 90.0 * len(batch))
    logs = "\n".join(pathlib.Path(log).read_text()[-3000:] for log in done["logs"])
    assert done["codes"] == [0] * world, logs
    return {
        name: [torch.load(root / name / f"rank{rank}.pt", weights_only=False) for rank in range(world)] for name in fits
    }


def written_bytes(directory: pathlib.Path) -> tuple[int, int]:
    """(bytes in the DCP files, bytes their metadata points at): equal when nothing was written twice or unread."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    referenced = sum(info.length for info in metadata.storage_data.values())
    on_disk = sum(path.stat().st_size for path in directory.glob("*.distcp"))
    return on_disk, referenced


# ---------------------------------------------------------------------------------------------- default suite
def test_shard_size_is_checked_with_the_fix() -> None:
    import lightning_zenflow
    from lightning_zenflow.strategies.fsdp import resolve_shard_size

    assert lightning_zenflow.ZenFlowFSDPStrategy().zenflow_config.checkpoint_format == "sharded"
    for wrong in (0, -2, "half", 1.5, True):
        with pytest.raises(MisconfigurationException, match="shard_size"):
            lightning_zenflow.ZenFlowFSDPStrategy(shard_size=wrong)
    assert resolve_shard_size("all", 8, 4) == 8
    assert resolve_shard_size("auto", 8, 4) == 4  # one machine per shard group
    assert resolve_shard_size(2, 8, 4) == 2
    with pytest.raises(MisconfigurationException, match="shard_size=3 does not divide the 8 ranks"):
        resolve_shard_size(3, 8, 4)
    strategy = lightning_zenflow.ZenFlowFSDPStrategy(shard_size=3)
    strategy.parallel_devices = [torch.device("cpu")] * 2  # what the trainer sets for devices=2
    with pytest.raises(MisconfigurationException, match="shard_size=3 does not divide the 2 ranks"):
        strategy.setup_environment()  # before any process group: refused before training starts


def test_hsdp_two_machines_of_one_rank_equal_one_process_and_write_each_block_once(tmp_path: pathlib.Path) -> None:
    """HSDP 2 x 1: every parameter replicated over 2 machines (FSDP2 all-reduces the gradients across them), each
    rank holding all rows and its own host worker; the selection agreed over both."""
    hsdp = {"devices": 1, "num_nodes": 2, "strategy": {**KNOBS, "shard_size": "auto"}, "checkpoint_every": 4}
    two = launch(tmp_path, {"hsdp": hsdp}, world=2)["hsdp"]
    one = launch(tmp_path, {"one": {"devices": 1, "fsdp": False, "strategy": KNOBS}}, world=1)["one"]
    assert [(r["node_rank"], r["local_rank"], r["world_size"]) for r in two] == [(0, 0, 2), (1, 0, 2)]
    assert two[0]["mesh_shape"] == (2, 1)
    assert set(two[0]["placements"]) == {"(Replicate(), Shard(dim=0))"}
    assert [r["engine_ranks"] for r in two] == [{"rank": 0, "world": 1, "replicas": 2}] * 2
    assert two[0]["global_step"] == one[0]["global_step"] == 8
    assert_weights_close(two[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)
    assert_weights_equal(two[1]["weights"], two[0]["weights"])  # the replicas hold the same model
    saved = tmp_path / "hsdp" / "step=4.ckpt"
    assert (saved / "meta.pt").is_file()  # a directory: sharded is the default under zenflow_fsdp
    on_disk, referenced = written_bytes(saved)
    assert on_disk == referenced  # each replicated block once, not once per machine


# ---------------------------------------------------------------------------------------------- slow tier: 4 ranks
TWO_BY_TWO = {"devices": 2, "num_nodes": 2}
HSDP = {**TWO_BY_TWO, "strategy": {**KNOBS, "shard_size": "auto"}, "checkpoint_every": 4}
FSDP4 = {**TWO_BY_TWO, "strategy": KNOBS, "checkpoint_every": 4}


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every 4-rank fit in one launch (the resumed one after the fit whose checkpoint it reads), then the 2-rank
    resume and the one-process fit."""
    root = tmp_path_factory.mktemp("hsdp")
    fits = {
        "hsdp_exact": {**TWO_BY_TWO, "strategy": {**EXACT, "shard_size": "auto"}},
        "hsdp_adamw": {**TWO_BY_TWO, "strategy": "adamw", "mesh": [2, 2]},
        # clipped by a norm every step exceeds: the norm of the shards over the 2-D mesh, counted once per replica
        "hsdp_exact_clipped": {**TWO_BY_TWO, "strategy": {**EXACT, "shard_size": "auto"}, "gradient_clip_val": 0.05},
        "hsdp_adamw_clipped": {**TWO_BY_TWO, "strategy": "adamw", "mesh": [2, 2], "gradient_clip_val": 0.05},
        "hsdp": HSDP,
        "fsdp4": FSDP4,
        # a checkpoint inside a window at an epoch's end (3 steps an epoch, S = 2: step 3 holds the open window's
        # gradient sum; Lightning does not resume an epoch's plain dataloader where a checkpoint inside it was taken)
        "fsdp4_mid": {**FSDP4, "checkpoint_every": 3, "samples": 36},
        # the HSDP 2 x 2 directory read by 4 ranks of plain FSDP (one machine of 4), and the other way
        "fsdp4_from_hsdp": {"devices": 4, "strategy": KNOBS, "ckpt_path": str(root / "hsdp" / "step=4.ckpt")},
        "hsdp_from_fsdp4": {**HSDP, "ckpt_path": str(root / "fsdp4" / "step=4.ckpt")},
        # the single file, gathered over each shard group and written by rank 0, resumed under HSDP
        "hsdp_full": {**HSDP, "strategy": {**HSDP["strategy"], "checkpoint_format": "full"}},
        "hsdp_from_full": {**HSDP, "ckpt_path": str(root / "hsdp_full" / "step=4.ckpt")},
    }
    results = launch(root, fits, world=4)
    two = {"devices": 2, "strategy": KNOBS, "ckpt_path": str(root / "fsdp4" / "step=4.ckpt")}
    mid = {**two, "samples": 36, "ckpt_path": str(root / "fsdp4_mid" / "step=3.ckpt")}
    results |= launch(root, {"fsdp2_from_fsdp4": two, "fsdp2_from_mid": mid}, world=2)
    one_clipped = {"devices": 1, "fsdp": False, "strategy": EXACT, "gradient_clip_val": 0.05}
    results |= launch(root, {"one": {"devices": 1, "fsdp": False, "strategy": KNOBS}, "one_clipped": one_clipped}, 1)
    return {"root": root, "results": results}


@pytest.mark.slow
def test_hsdp_two_by_two_equals_fully_shard_on_the_same_mesh_with_adamw(four: dict) -> None:
    zenflow, adamw = four["results"]["hsdp_exact"], four["results"]["hsdp_adamw"]
    assert [r["strategy"] for r in zenflow] == ["ZenFlowFSDPStrategy"] * 4
    assert [r["strategy"] for r in adamw] == ["ModelParallelStrategy"] * 4
    assert [(r["node_rank"], r["local_rank"]) for r in zenflow] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {r["mesh_shape"] for r in zenflow} == {(2, 2)}
    assert set(zenflow[0]["placements"]) == set(adamw[0]["placements"]) == {"(Replicate(), Shard(dim=0))"}
    # the shard group splits the rows, the other machine holds the same ones
    assert [r["engine_ranks"] for r in zenflow] == [{"rank": r % 2, "world": 2, "replicas": 2} for r in range(4)]
    assert zenflow[0]["global_step"] == adamw[0]["global_step"] == 8
    assert_weights_close(zenflow[0]["weights"], adamw[0]["weights"], atol=1e-6, rtol=0.0)
    for rank in range(1, 4):
        assert_weights_equal(zenflow[rank]["weights"], zenflow[0]["weights"])
    clipped, adamw_clipped = four["results"]["hsdp_exact_clipped"], four["results"]["hsdp_adamw_clipped"]
    assert_weights_close(clipped[0]["weights"], adamw_clipped[0]["weights"], atol=1e-6, rtol=0.0)
    unclipped = adamw[0]["weights"]
    moved = max((adamw_clipped[0]["weights"][k] - unclipped[k]).abs().max().item() for k in unclipped)
    assert moved > 1e-4, f"the threshold did not clip (weights moved by {moved:.1e} at most)"
    # one process clips by the whole gradient's norm: the replicas' copies of a shard are not counted twice
    assert_weights_close(clipped[0]["weights"], four["results"]["one_clipped"][0]["weights"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_hsdp_two_by_two_equals_one_process_and_fsdp_on_the_global_batch(four: dict) -> None:
    # column scores and interim sums over the shard group (the replicas' gradients are already all-reduced): each
    # rank chooses what one process chooses from the whole gradient
    hsdp, fsdp4, one = (four["results"][name] for name in ("hsdp", "fsdp4", "one"))
    assert one[0]["strategy"] == "ZenFlowStrategy"
    assert hsdp[0]["global_step"] == fsdp4[0]["global_step"] == one[0]["global_step"] == 8
    assert_weights_close(hsdp[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)
    assert_weights_close(fsdp4[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)
    assert [r["engine_ranks"] for r in fsdp4] == [{"rank": r, "world": 4, "replicas": 1} for r in range(4)]


@pytest.mark.slow
def test_a_sharded_checkpoint_at_four_ranks_resumes_at_two(four: dict) -> None:
    saved = four["root"] / "fsdp4" / "step=4.ckpt"
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", *(f"__{r}_0.distcp" for r in range(4)), "meta.pt"]
    resumed, uninterrupted = four["results"]["fsdp2_from_fsdp4"], four["results"]["fsdp4"]
    assert resumed[0]["global_step"] == 8
    assert [r["engine_ranks"] for r in resumed] == [{"rank": r, "world": 2, "replicas": 1} for r in range(2)]
    assert_weights_close(resumed[0]["weights"], uninterrupted[0]["weights"], atol=1e-6, rtol=1e-5)
    # inside a window: the open window's gradient sum is saved by rows too, and re-split
    mid = four["root"] / "fsdp4_mid" / "step=3.ckpt"
    import torch.distributed.checkpoint as dcp

    written = dcp.FileSystemReader(str(mid)).read_metadata().state_dict_metadata
    assert tuple(written["zenflow.net.0.weight.grad_acc"].size) == (24, 8)  # the whole matrix's shape
    from_mid, uninterrupted = four["results"]["fsdp2_from_mid"], four["results"]["fsdp4_mid"]
    assert from_mid[0]["global_step"] == 8
    assert_weights_close(from_mid[0]["weights"], uninterrupted[0]["weights"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_sharded_checkpoint_under_hsdp_resumes_at_four_ranks_of_fsdp(four: dict) -> None:
    saved = four["root"] / "hsdp" / "step=4.ckpt"
    on_disk, referenced = written_bytes(saved)
    assert on_disk == referenced  # the replica group on the second machine wrote no block twice
    resumed, uninterrupted = four["results"]["fsdp4_from_hsdp"], four["results"]["hsdp"]
    assert resumed[0]["mesh_shape"] == (4,)
    assert resumed[0]["global_step"] == 8
    assert_weights_close(resumed[0]["weights"], uninterrupted[0]["weights"], atol=1e-6, rtol=1e-5)
    # and back: written by 4 ranks of FSDP, resumed under HSDP 2 x 2
    back = four["results"]["hsdp_from_fsdp4"]
    assert back[0]["mesh_shape"] == (2, 2)
    assert_weights_close(back[0]["weights"], four["results"]["fsdp4"][0]["weights"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_full_checkpoint_under_hsdp_is_one_file_that_resumes(four: dict) -> None:
    saved = four["root"] / "hsdp_full" / "step=4.ckpt"
    assert saved.is_file()
    assert "zenflow" in torch.load(saved, weights_only=False)  # the whole state, gathered within a shard group
    uninterrupted, resumed = four["results"]["hsdp_full"], four["results"]["hsdp_from_full"]
    assert_weights_equal(uninterrupted[0]["weights"], four["results"]["hsdp"][0]["weights"])  # the format: no change
    assert resumed[0]["global_step"] == 8
    assert_weights_close(resumed[0]["weights"], uninterrupted[0]["weights"], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_a_module_sharded_on_the_data_parallel_mesh_under_hsdp_is_refused(tmp_path: pathlib.Path) -> None:
    options = {"entry": ENTRY, "devices": 1, "num_nodes": 2, "batch_size": 6, "lightning_mesh": True}
    options["strategy"] = {**KNOBS, "shard_size": "auto"}
    done = Zygote.run(tmp_path, {"batch": [[str(tmp_path / "fit"), options]]}, world=2, timeout_s=120)
    assert done["codes"] == [1, 1]
    log = pathlib.Path(done["logs"][0]).read_text()
    assert "fully_shard(module, mesh=self.trainer.strategy.shard_mesh)" in log
    assert "HSDP's (replicate, shard) mesh" in log


@pytest.mark.slow
def test_torchrun_on_two_machines_needs_nothing_special(tmp_path: pathlib.Path) -> None:
    """The recipe of docs/distributed.md, "HSDP": one ``torchrun --nnodes 2 --node-rank R`` per machine (both here,
    a static rendezvous), the same script on each; Lightning reads torchrun's variables, HSDP 2 x 1 follows."""
    from distributed_helpers import free_port

    script = pathlib.Path(__file__).parent / "ddp_script.py"
    options = {"entry": ENTRY, "launched": True, "devices": 1, "num_nodes": 2, "batch_size": GLOBAL_BATCH // 2}
    options["strategy"] = {**KNOBS, "shard_size": "auto"}
    port = str(free_port())
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    machines = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
            + ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", port]
            + [str(script), str(tmp_path / "torchrun"), json.dumps(options)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = []
    try:
        for machine in machines:
            outputs.append(machine.communicate(timeout=240)[0])
    finally:
        for machine in machines:
            if machine.poll() is None:
                machine.kill()
                machine.wait()
    assert [machine.returncode for machine in machines] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    ranks = [torch.load(tmp_path / "torchrun" / f"rank{rank}.pt", weights_only=False) for rank in range(2)]
    assert [(r["node_rank"], r["local_rank"], r["world_size"]) for r in ranks] == [(0, 0, 2), (1, 0, 2)]
    assert ranks[0]["mesh_shape"] == (2, 1)
    assert [r["engine_ranks"] for r in ranks] == [{"rank": 0, "world": 1, "replicas": 2}] * 2
    one = launch(tmp_path, {"one": {"devices": 1, "fsdp": False, "strategy": KNOBS}}, world=1)["one"]
    assert_weights_close(ranks[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)
    assert_weights_equal(ranks[1]["weights"], ranks[0]["weights"])


@pytest.mark.slow
def test_ranks_reduce_rows_over_the_shard_group_and_agree_over_every_rank(tmp_path: pathlib.Path) -> None:
    """``engine/ranks.py`` under HSDP 2 x 2 (groups {0, 1} and {2, 3}): the column scores, the sums and the gathers
    of rows stay inside a shard group (its rank 0 is a global rank 2 in the second), the agreed numbers and the
    selection span all four."""
    from distributed_helpers import hsdp_ranks_rank, load_results, run_ranks

    assert run_ranks(hsdp_ranks_rank, 4, str(tmp_path)) == [0] * 4
    results = load_results(tmp_path, 4)
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    assert [r["scores"][0].item() for r in results] == [3.0, 3.0, 7.0, 7.0]  # 1 + 2, 3 + 4
    assert [r["summed"].item() for r in results] == [2.0] * 4
    assert [r["agreed"] for r in results] == [3.0] * 4
    assert all(r["selection"].tolist() == [0.0, 0.0] for r in results)  # global rank 0's, on the other machine too
    # each shard group's rank 0 gathers its group's rows (blocks of 3 and 2 rows): group 2's from global ranks 2, 3
    assert results[0]["gathered"][:, 0].tolist() == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert results[2]["gathered"][:, 0].tolist() == [2.0, 2.0, 2.0, 3.0, 3.0]
    assert results[1]["gathered"] is None
    assert results[3]["gathered"] is None
