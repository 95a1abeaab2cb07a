"""Data-parallel engine on the CPU (gloo): the host state sharded by rows across ranks must not change the rule.

Ranks are real processes, each with its own host worker. Checked here without Lightning (the strategy's tests are
in ``test_lightning_ddp.py``): sharded equals one rank for the same gradients, in both accumulation modes and
with matrices whose rows the ranks do not divide evenly (one rank owning no row of a matrix); data parallel over
split batches equals one rank over the whole batch; the degenerate cases equal AdamW; a state saved at 2 ranks
resumes at 1 and 3 ranks as the uninterrupted run; host bytes and link bytes per rank drop with the ranks.

"Equal" is to float tolerance, not bit for bit: the host AdamW runs over each rank's rows as one contiguous
vector, and the CPU's vectorised kernels round the last elements of a vector (the scalar tail) differently from
the rest (measured: exp_avg_sq differs by about 1e-13 at a few row ends). Everything else is exact: the rows move
by copies and broadcasts, and the entering columns by a sum with zeros.
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from distributed_helpers import SmallNet, batch, engine_ranks, load_results, resume_rank, run_ranks

BASE = {"topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step", "select_interval": 4}
STEPS = 11  # selections at steps 1 and 6 and 10, a partial window closed by the flush
CHECKPOINT_AT = 9  # a host update computed and not applied, one step of the next window accumulated
DEGENERATE = [  # compared with torch's AdamW: the exact state
    {"topk_ratio": 1.0, "update_interval": 3, "accumulate_on": "device", "host_state": "fp32"},
    {"topk_ratio": 0.0, "update_interval": 1, "overlap_step": False, "accumulate_on": "host", "host_state": "fp32"},
]
WARM_UPS = ({}, {"full_warm_up_rounds": 3})
MODES = [{**BASE, "accumulate_on": mode, **warm} for warm in WARM_UPS for mode in ("device", "host")]
PLANNED = [
    *((config, world, True, None) for world in (1, 2) for config in MODES),
    ({**BASE, "accumulate_on": "device"}, 2, False, None),
    *((config, 2, False, None) for config in DEGENERATE),
    ({**BASE, "accumulate_on": "host"}, 3, True, None),
]
"""(config, world, same_batch, slow_rank) of every run the tests below ask for, but the slow rank's."""


class Runs:
    """Each configuration is run once per module and shared by the tests that compare it. The first request for a
    number of ranks runs, in the same processes and one after another, every configuration of that many ranks that
    :data:`PLANNED` names (one start-up of the ranks per rank count, not per configuration)."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.cache: dict[tuple, list[dict]] = {}

    def get(self, config: dict, world: int, same_batch: bool = True, slow_rank: int | None = None) -> list[dict]:
        key = _key(config, world, same_batch, slow_rank)
        if key not in self.cache:
            batch = [(config, world, same_batch, slow_rank)]
            if slow_rank is None:  # timings are the point of a slow rank: it runs alone
                fitted = {*self.cache, key}
                batch += [job for job in PLANNED if job[1] == world and _key(*job) not in fitted]
            outs = []
            for _ in batch:
                outs.append(self.root / f"run{len(self.cache) + len(outs)}")
                outs[-1].mkdir()
            jobs = [(c, STEPS, str(out), same, CHECKPOINT_AT, slow) for (c, _, same, slow), out in zip(batch, outs)]
            codes = run_ranks(engine_ranks, world, jobs, timeout_s=60.0 + 30.0 * len(jobs))
            assert codes == [0] * world, f"ranks exited with {codes}"
            for job, out in zip(batch, outs):
                self.cache[_key(*job)] = load_results(out, world)
        return self.cache[key]


def _key(config: dict, world: int, same_batch: bool = True, slow_rank: int | None = None) -> tuple:
    return (tuple(sorted(config.items())), world, same_batch, slow_rank)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return Runs(tmp_path_factory.mktemp("ranks"))


def assert_equal_dicts(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert torch.equal(actual[key], expected[key]), key


def assert_close_dicts(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        # not bitwise: with interim_step (on at these settings) a host step lands unrounded by a master, and torch's
        # fused CPU AdamW kernel divides by the window's count with other rounding in its remainder loop than in its
        # vector loop, so a row block that ends elsewhere can move a weight by an ulp
        torch.testing.assert_close(actual[key], expected[key], rtol=1e-6, atol=1e-7, msg=key)


def assert_close_torch_state(actual: dict, expected: dict) -> None:
    assert actual["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert torch.equal(actual["state"][index]["step"], entry["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            # float rounding apart, as the weights (assert_close_dicts)
            torch.testing.assert_close(actual["state"][index][key], entry[key], rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize(("mode", "world"), [("device", 2), ("host", 2), ("host", 3)])
def test_sharded_host_state_equals_one_rank(runs: Runs, mode: str, world: int) -> None:
    config = {**BASE, "accumulate_on": mode}
    one = runs.get(config, 1)[0]
    ranks = runs.get(config, world)
    for result in ranks:
        # every rank holds the whole model, equal to one rank's
        assert_close_dicts(result["weights"], one["weights"])
        assert result["accumulate_on"] == mode
    # the consolidated state is rank 0's, the others' is empty
    assert_close_torch_state(ranks[0]["torch_state"], one["torch_state"])
    assert all(result["torch_state"]["state"] == {} for result in ranks[1:])
    for result in ranks[1:]:
        assert_equal_dicts(result["weights"], ranks[0]["weights"])  # replicas: bit for bit


@pytest.mark.parametrize("mode", ["device", "host"])
def test_sharded_warm_up_equals_one_rank(runs: Runs, mode: str) -> None:
    """The default's warm-up (synchronous full updates of every rank's rows, landed on every rank) then the rule:
    two ranks hold what one rank holds."""
    config = {**BASE, "accumulate_on": mode, "full_warm_up_rounds": 3}
    one = runs.get(config, 1)[0]
    for result in runs.get(config, 2):
        assert_close_dicts(result["weights"], one["weights"])
    assert_close_torch_state(runs.get(config, 2)[0]["torch_state"], one["torch_state"])


def test_host_and_link_bytes_per_rank_shrink_with_the_ranks(runs: Runs) -> None:
    config = {**BASE, "accumulate_on": "host"}
    one = runs.get(config, 1)[0]
    two = runs.get(config, 2)
    host_one = one["host_bytes"]
    for result in two:
        # the host blocks hold about half the elements (the small per-matrix column lists are not sharded)
        assert result["host_bytes"] < 0.75 * host_one
    d2h_one = sum(d for d, _ in one["link"])
    d2h_two = [sum(d for d, _ in result["link"]) for result in two]
    assert sum(d2h_two) == d2h_one  # each rank copies down its own rows: together, the one rank's bytes
    assert all(0 < d < d2h_one for d in d2h_two)


def test_data_parallel_equals_one_rank_with_the_whole_batch(runs: Runs) -> None:
    config = {**BASE, "accumulate_on": "device"}
    one = runs.get(config, 1)[0]
    two = runs.get(config, 2, same_batch=False)
    assert_equal_dicts(two[1]["weights"], two[0]["weights"])  # replicas hold identical weights
    for key, value in one["weights"].items():
        torch.testing.assert_close(two[0]["weights"][key], value, rtol=1e-5, atol=1e-6)


def plain_adamw(steps: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    for step in range(1, steps + 1):
        inputs, targets = batch(step)
        (model(inputs) - targets).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("config", DEGENERATE, ids=["rho1", "rho0-S1-sync"])
def test_degenerate_cases_equal_adamw_at_two_ranks(runs: Runs, config: dict) -> None:
    two = runs.get(config, 2, same_batch=False)
    expected = plain_adamw(STEPS)
    for key, value in expected.items():
        torch.testing.assert_close(two[0]["weights"][key], value, rtol=1e-5, atol=1e-6)
        assert torch.equal(two[1]["weights"][key], two[0]["weights"][key])


@pytest.mark.parametrize("resume_world", [1, 3])
def test_state_saved_at_two_ranks_resumes_at_other_counts(
    runs: Runs, tmp_path: pathlib.Path, resume_world: int
) -> None:
    config = {**BASE, "accumulate_on": "host"}
    uninterrupted = runs.get(config, 1)[0]
    saved = runs.get(config, 2)
    progress = saved[0]["checkpoint"]["engine"]["progress"]
    assert progress["pending"] is not None
    assert progress["steps_in_window"] == 1
    assert_equal_dicts(saved[1]["checkpoint"]["weights"], saved[0]["checkpoint"]["weights"])
    checkpoint = tmp_path / "state.pt"
    torch.save(saved[0]["checkpoint"], checkpoint)
    out = tmp_path / "resumed"
    out.mkdir()
    codes = run_ranks(resume_rank, resume_world, config, str(checkpoint), STEPS - CHECKPOINT_AT, str(out))
    assert codes == [0] * resume_world
    for result in load_results(out, resume_world):
        assert_close_dicts(result["weights"], uninterrupted["weights"])


def test_ranks_agree_on_an_automatic_interval_when_their_timings_differ(runs: Runs) -> None:
    # rank 1's worker is slow: alone it would choose a longer window than rank 0; both must take the same one
    # (different windows would desynchronise the landings' broadcasts and hang the run)
    config = {"topk_ratio": 0.25, "update_interval": "auto", "accumulate_on": "device"}
    ranks = runs.get(config, 2, slow_rank=1)
    assert ranks[0]["interval"] == ranks[1]["interval"]
    assert_equal_dicts(ranks[1]["weights"], ranks[0]["weights"])


def test_ranks_on_one_machine_take_disjoint_cores_unless_a_launcher_bound_them() -> None:
    from lightning_zenflow.engine.ranks import Ranks

    everything = list(range(16))
    slices = [Ranks(rank=r, world=4, local_rank=r, local_world=4).own_cores(everything, 16) for r in range(4)]
    assert slices == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    # bound by the launcher (4 of 16 cores for each of 4 ranks): kept as it is
    assert Ranks(rank=1, world=4, local_rank=1, local_world=4).own_cores([5, 7, 9, 11], 16) == [5, 7, 9, 11]
    assert Ranks().own_cores(everything, 16) == everything
    # more ranks than cores: each still gets one
    assert Ranks(rank=2, world=3, local_rank=2, local_world=3).own_cores([0, 1], 2) == [1]


def test_row_blocks_follow_torch_chunk() -> None:
    from lightning_zenflow.engine.ranks import Ranks

    for rows in (1, 4, 5, 9, 64):
        for world in (1, 2, 3, 8):
            blocks = Ranks(rank=0, world=world).row_range(rows)
            chunks = [c.shape[0] for c in torch.arange(rows).chunk(world)]
            sizes = [stop - start for start, stop in blocks]
            assert sizes[: len(chunks)] == chunks
            assert sum(sizes) == rows
            assert all(size == 0 for size in sizes[len(chunks) :])


def test_preflight_counts_every_rank_on_the_machine() -> None:
    from lightning_zenflow.engine.layout import build_layout
    from lightning_zenflow.engine.preflight import HostResourceError, MachineResources, check_host_resources

    layout = build_layout([{"params": [torch.nn.Parameter(torch.zeros(1024, 1024))]}])
    need = 6 * 1024 * 1024  # the default format: bf16 moments and window row
    machine = MachineResources(
        shm_free_bytes=3 * need,
        shm_total_bytes=4 * need,
        ram_available_bytes=64 * need,  # shared memory decides here
        ram_source="MemAvailable",
        memlock_soft_bytes=None,
        memlock_hard_bytes=None,
    )
    check_host_resources(layout, torch.device("cpu"), machine, ranks_per_host=2)
    with pytest.raises(HostResourceError):
        check_host_resources(layout, torch.device("cpu"), machine, ranks_per_host=4)
