"""Data-parallel ZenFlow under Lightning: ``Trainer(strategy="zenflow", devices=2)`` on the CPU (gloo, 2 ranks).

Every rank runs ``tests/ddp_script.py``'s fits and writes its results to a file; the assertions run here. The fits
that compare numbers start their ranks as a cluster launcher does, forked from a process that imported Lightning
once (``tests/rank_zygote.py``); the faults, Ctrl-C and the console script run ``ddp_script.py`` as a script, whose
second rank Lightning's subprocess launcher starts. The one-rank fits they are compared with run the same script's
``fit`` in this process. Covered: the
strategy becomes data parallel by name and as an object; 2 ranks with batch b equal 1 rank with batch 2b; the
degenerate case equals Lightning's AdamW; replicas hold the same weights; each rank holds half the host state and
copies down half the bytes; a checkpoint written mid-run at 2 ranks resumes at 1 rank as the rest of the run, and
under Lightning's plain AdamW; a plain AdamW checkpoint resumes at 2 ranks; a worker killed on one rank ends both
ranks with the error, leaving no process.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import ddp_script
import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning_helpers import assert_weights_close, assert_weights_equal, make_trainer, process_gone
from memory_probe import assert_holds_what_it_counts
from rank_zygote import Zygote

SCRIPT = pathlib.Path(__file__).parent / "ddp_script.py"
KNOBS = {"topk_ratio": 0.25, "update_interval": 2, "select_strategy": "step", "select_interval": 4}


def run_script(out: pathlib.Path, timeout_s: float = 240.0, **options: object) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(out), json.dumps(options)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )


def results(out: pathlib.Path, ranks: int) -> list[dict]:
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(ranks)]


def _key(options: dict) -> str:
    return json.dumps(options, sort_keys=True)


class Fits:
    """Each configuration is fitted once per module and shared by the tests that compare it.

    One-rank fits (not FSDP2) run in this process. The others run in forked ranks (``rank_zygote``), in batches: the
    first request for a
    number of ranks launches it together with every configuration :meth:`plan` named for that many ranks (and the
    same ``fsdp``) that is not fitted yet and whose checkpoint, if it resumes one, exists; the batch runs one fit after
    another in one set of processes, so a module pays the start-up of its ranks once per batch, not once per fit."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        self.cache: dict[str, list[dict]] = {}
        self.planned: list[dict] = []

    def plan(self, *configs: dict) -> None:
        self.planned.extend(configs)

    def dir(self, **options: object) -> pathlib.Path:
        """Where the fit of ``options`` writes (its checkpoints included), fitted or not."""
        return self.root / f"fit-{hashlib.sha1(_key(options).encode()).hexdigest()[:12]}"

    def get(self, **options: object) -> list[dict]:
        key = _key(options)
        if key not in self.cache:
            devices = int(options.get("devices", 1))  # type: ignore[arg-type]
            if devices == 1 and not options.get("fsdp"):
                # one rank needs no launcher: the same fit in this process (no Lightning import to pay again)
                out = self.dir(**options)
                out.mkdir(parents=True)
                ddp_script.fit(out, json.loads(key))
                self.cache[key] = results(out, 1)
            else:
                self._launch(options)
        return self.cache[key]

    def _launch(self, options: dict) -> None:
        def joins(other: dict) -> bool:
            same = all(other.get(k) == options.get(k) for k in ("devices", "fsdp", "accelerator"))
            resumable = not other.get("ckpt_path") or pathlib.Path(str(other["ckpt_path"])).exists()
            return same and resumable and _key(other) not in self.cache and _key(other) != _key(options)

        batch = [options, *(other for other in self.planned if joins(other))]
        out = self.root / f"launch{len(list(self.root.glob('launch*')))}"
        done = Zygote.run(
            out,
            {"batch": [[str(self.dir(**each)), each] for each in batch]},
            world=int(options.get("devices", 1)),  # type: ignore[arg-type]
            timeout_s=120.0 + 60.0 * len(batch),
        )
        logs = "\n".join(pathlib.Path(log).read_text()[-3000:] for log in done["logs"])
        assert done["codes"] == [0] * len(done["codes"]), logs
        for each in batch:
            self.cache[_key(each)] = results(self.dir(**each), int(each.get("devices", 1)))


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> Fits:
    fits = Fits(tmp_path_factory.mktemp("fits"))
    fits.plan(  # every two-rank fit below that resumes nothing: one launch
        {"devices": 2, "strategy": KNOBS, "batch_size": 4},
        {"devices": 2, "strategy": KNOBS, "batch_size": 2, "accumulate_grad_batches": 2},
        {"devices": 2, "strategy": {"topk_ratio": 1.0}, "batch_size": 4},
        {"devices": 2, "strategy": "adamw", "batch_size": 4},
        CHECKPOINTED,
        SHARDED_CHECKPOINTED,
    )
    return fits


CHECKPOINTED = {"devices": 2, "strategy": KNOBS, "batch_size": 4, "checkpoint_every": 4}
SHARDED_KNOBS = {**KNOBS, "checkpoint_format": "sharded", "accumulate_on": "host"}
SHARDED_CHECKPOINTED = {**CHECKPOINTED, "strategy": SHARDED_KNOBS, "save_after": True}


def test_zenflow_by_name_and_as_object_becomes_data_parallel() -> None:
    import lightning_zenflow

    for strategy in ("zenflow", lightning_zenflow.ZenFlowStrategy(full_warm_up_rounds=0, topk_ratio=0.3)):
        trainer = make_trainer(strategy, devices=2)
        assert isinstance(trainer.strategy, lightning_zenflow.ZenFlowDDPStrategy)
        assert trainer.strategy.num_processes == 2
        assert trainer._accelerator_connector.is_distributed  # Lightning adds its distributed sampler
    assert trainer.strategy.zenflow_config.topk_ratio == 0.3  # the knobs survive
    assert isinstance(make_trainer("zenflow", devices=1).strategy, lightning_zenflow.ZenFlowStrategy)
    assert isinstance(make_trainer("zenflow_ddp_spawn", devices=2).strategy, lightning_zenflow.ZenFlowDDPStrategy)


def test_an_explicit_device_with_several_devices_fails_with_the_fix() -> None:
    import lightning_zenflow

    with pytest.raises(MisconfigurationException, match="Leave out `device`"):
        make_trainer(lightning_zenflow.ZenFlowStrategy(full_warm_up_rounds=0, device="cpu"), devices=2)


def test_two_ranks_equal_one_rank_with_the_doubled_batch(fits: Fits) -> None:
    two = fits.get(devices=2, strategy=KNOBS, batch_size=4)
    one = fits.get(devices=1, strategy=KNOBS, batch_size=8)
    assert [r["strategy"] for r in two] == ["ZenFlowDDPStrategy"] * 2
    assert two[0]["world_size"] == 2
    assert two[0]["global_step"] == one[0]["global_step"] == 8
    assert_weights_equal(two[1]["weights"], two[0]["weights"])  # replicas
    assert_weights_close(two[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)
    # each rank holds half the matrices' host state and copies down half the bytes
    assert two[0]["host_bytes"] < 0.75 * one[0]["host_bytes"]
    d2h_one = sum(d for d, _ in one[0]["link"])
    assert sum(d for d, _ in two[0]["link"]) + sum(d for d, _ in two[1]["link"]) == d2h_one


def test_each_rank_holds_what_it_counts_and_the_machine_what_one_rank_holds(fits: Fits) -> None:
    """Per rank, the engine's host and device bytes equal ``engine/budget.py``'s formulas, the /dev/shm segments the
    rank maps and its worker holds resident are those rows (tests/memory_probe.py); per machine, the two ranks' host
    rows cover the one rank's elements exactly once."""
    one = fits.get(devices=1, strategy=KNOBS, batch_size=8)
    two = fits.get(devices=2, strategy=KNOBS, batch_size=4)
    for result in (*one, *two):
        assert_holds_what_it_counts(result["memory"])
    assert sum(result["memory"]["elements"] for result in two) == one[0]["memory"]["elements"]
    per_element = {result["memory"]["counted_host"] - result["memory"]["rows"] for result in (*one, *two)}
    assert per_element == {0}


def test_gradient_accumulation_across_ranks(fits: Fits) -> None:
    # DDP skips the all-reduce of the accumulating micro-batches (Lightning's no_sync); the optimizer step sees the
    # same averaged gradient as one rank accumulating the same samples
    two = fits.get(devices=2, strategy=KNOBS, batch_size=2, accumulate_grad_batches=2)
    one = fits.get(devices=1, strategy=KNOBS, batch_size=4, accumulate_grad_batches=2)
    assert two[0]["global_step"] == one[0]["global_step"] == 8
    assert_weights_equal(two[1]["weights"], two[0]["weights"])
    assert_weights_close(two[0]["weights"], one[0]["weights"], atol=1e-6, rtol=1e-5)


def test_degenerate_case_equals_lightning_adamw(fits: Fits) -> None:
    zenflow = fits.get(devices=2, strategy={"topk_ratio": 1.0}, batch_size=4)
    adamw = fits.get(devices=2, strategy="adamw", batch_size=4)
    assert_weights_close(zenflow[0]["weights"], adamw[0]["weights"], atol=1e-6, rtol=1e-5)


def test_checkpoints_move_between_rank_counts_and_plain_adamw(fits: Fits) -> None:
    # ModelCheckpoint at step 4: mid-run, mid-window (S 2 and a sync at the checkpoint), a selection in place
    two = fits.get(**CHECKPOINTED)
    saved = fits.dir(**CHECKPOINTED) / "step=4.ckpt"
    assert saved.exists()
    # 2 ranks -> 1 rank: the rest of the 2-rank run, to float tolerance
    resumed = fits.get(devices=1, strategy=KNOBS, batch_size=8, ckpt_path=str(saved), checkpoint_every=4)
    assert resumed[0]["global_step"] == 8
    assert_weights_close(resumed[0]["weights"], two[0]["weights"], atol=1e-6, rtol=1e-5)
    # the same file is an ordinary AdamW checkpoint: Lightning's own AdamW resumes it
    plain = fits.get(devices=1, strategy="adamw", batch_size=8, ckpt_path=str(saved))
    assert plain[0]["global_step"] == 8
    # and a plain AdamW checkpoint resumes under ZenFlow at 2 ranks
    plain_checkpointed = {"devices": 1, "strategy": "adamw", "batch_size": 8, "checkpoint_every": 4}
    fits.get(**plain_checkpointed)
    saved_adamw = fits.dir(**plain_checkpointed) / "step=4.ckpt"
    into_two = fits.get(devices=2, strategy=KNOBS, batch_size=4, ckpt_path=str(saved_adamw))
    assert into_two[0]["global_step"] == 8
    assert_weights_equal(into_two[1]["weights"], into_two[0]["weights"])


def test_a_sharded_checkpoint_written_at_two_ranks_resumes_at_one(fits: Fits) -> None:
    knobs = SHARDED_KNOBS
    two = fits.get(**SHARDED_CHECKPOINTED)
    run = fits.dir(**SHARDED_CHECKPOINTED)
    saved = run / "step=4.ckpt"
    # a directory: the meta file and one torch.distributed.checkpoint file per rank
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]
    resumed = fits.get(devices=1, strategy=knobs, batch_size=8, ckpt_path=str(saved))
    assert resumed[0]["global_step"] == 8
    assert_weights_close(resumed[0]["weights"], two[0]["weights"], atol=1e-6, rtol=1e-5)
    # saved after the fit (the engine closed, its row blocks kept): resumes with the final weights
    after = fits.get(devices=1, strategy=knobs, batch_size=8, ckpt_path=str(run / "after.ckpt"), max_steps=8)
    assert after[0]["global_step"] == 8
    assert_weights_close(after[0]["weights"], two[0]["weights"], atol=0.0, rtol=0.0)


def assert_nothing_left(out: pathlib.Path) -> None:
    """No rank process and no host worker of the run is alive (a few seconds' grace for the last exits)."""
    for kind in ("rank", "worker"):
        for rank in range(2):
            pid = int((out / f"{kind}{rank}.pid").read_text())
            deadline = time.monotonic() + 10
            while not process_gone(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert process_gone(pid), f"the {kind} process of rank {rank} outlived the run"


@pytest.mark.parametrize(
    ("fault", "rank", "message"),
    [("kill_worker_at", 1, "host worker"), ("kill_worker_at", 0, "host worker"), ("fail_at", 1, "rank 1's training")],
)
def test_a_fault_on_one_rank_ends_every_rank(tmp_path: pathlib.Path, fault: str, rank: int, message: str) -> None:
    # rank 0 is the launcher: it ends the rank it started; a failing rank 1 ends rank 0 through the collectives
    started = time.monotonic()
    done = run_script(tmp_path, devices=2, strategy=KNOBS, max_steps=400, fault_rank=rank, **{fault: 3})
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    assert message in done.stderr
    assert not (tmp_path / "rank0.pt").exists()
    assert_nothing_left(tmp_path)
    assert elapsed < 200  # far below the 400 steps; the collective timeout here is 60 s


def test_ctrl_c_ends_every_rank(tmp_path: pathlib.Path) -> None:
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    # a fit far longer than the test waits: only the interrupt can end it
    options = json.dumps({"devices": 2, "strategy": KNOBS, "max_steps": 10**6, "max_epochs": 10**6})
    # its own session: Ctrl-C in a terminal signals the whole foreground process group, as killpg does here. A shell
    # starts a foreground job with SIGINT at its default; the test process may pass it on ignored (an ignored signal
    # survives exec), and then the script would train on through the Ctrl-C, so the child resets it first
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path), options],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    stderr = ""
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"worker{rank}.pid").exists() for rank in range(2)):
            assert process.poll() is None, process.stderr.read() if process.stderr else ""
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        for rank in range(2):  # Ctrl-C raises KeyboardInterrupt in every rank (no inherited SIG_IGN)
            assert (tmp_path / f"sigint{rank}.txt").read_text() == repr(signal.default_int_handler), rank
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGINT)
        try:
            _, stderr = process.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate()
            pytest.fail(f"Ctrl-C did not end the run within 90 s:\n{stderr[-6000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode != 0, f"the interrupted run exited 0:\n{stderr[-6000:]}"
    assert not (tmp_path / "rank0.pt").exists(), "the fit ran to its end"
    assert_nothing_left(tmp_path)


TWO_RANK_YAML = """
seed_everything: 0
trainer:
  accelerator: cpu
  devices: 2
  strategy: zenflow
  max_steps: 4
  max_epochs: 1
  limit_val_batches: 2
  val_check_interval: 2
  enable_progress_bar: false
  logger: false
  enable_checkpointing: false
model:
  class_path: lightning_zenflow.demo.CausalLMModule
  init_args: {n_layer: 1, n_head: 2, n_embd: 32, block_size: 32}
data:
  class_path: lightning_zenflow.demo.ByteCorpusDataModule
  init_args: {block_size: 32, batch_size: 4, max_bytes: 200000}
"""


def test_console_script_with_a_two_rank_yaml(tmp_path: pathlib.Path) -> None:
    import shutil

    script = shutil.which("lightning-zenflow", path=str(pathlib.Path(sys.executable).parent))
    if script is None:
        pytest.skip("the lightning-zenflow console script is not installed (python -m pip install -e .)")
    (tmp_path / "two.yaml").write_text(TWO_RANK_YAML)
    env = {key: value for key, value in os.environ.items() if key not in ("MASTER_PORT", "LOCAL_RANK", "WORLD_SIZE")}
    done = subprocess.run(
        [script, "fit", "--config", "two.yaml", "--trainer.strategy.host_threads=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in output
    assert "ZenFlow run summary: 4 optimizer steps" in output
