"""Same inputs, same bits (DESIGN section 4): a Lightning fit with dropout, clipping and two param groups, in the
compact host state with compiled kernels, gives the same weights on every run: with an empty compile cache and a warm
one, alone and beside a CPU hog; and it leaves the RNG that dropout draws from, and the default dtype, as plain AdamW
leaves them at every step.

Before the kernels were built ahead of time (``engine/compiled.py``), the same script gave a different digest on
every run: the window sum compiled on a lane thread during the forward, and dynamo's restore of the RNG state and the
default dtype rewound dropout's RNG and leaked bf16 as the default (three runs, three digests).
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import determinism_script
import pytest
import torch

from lightning_zenflow.engine import compiled as compiled_module
from lightning_zenflow.engine import kernels as kernels_module
from lightning_zenflow.engine.kernels import KERNELS_ENV

pytestmark = [
    pytest.mark.usefixtures("no_leaked_children"),
    pytest.mark.skipif(
        kernels_module.compiler_missing(torch.device("cpu")) is not None or compiled_module.aot_available() is not None,
        reason="no C++ compiler for torch.compile, or no ahead-of-time builds in this torch",
    ),
]

SCRIPT = pathlib.Path(__file__).with_name("determinism_script.py")
STEPS = 20
"""Enough for the warm-up, the first selection, windows, landings and the worker's first updates (S = 4): the version
before the kernels were built ahead of time gave two sets of weights in two fits of 20 steps in one process, and an RNG
other than AdamW's."""


def run(*args: str, cache: pathlib.Path | None = None) -> dict:
    env = {**os.environ, KERNELS_ENV: ""}
    if cache is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", str(STEPS), *args],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "leaked" not in result.stderr, result.stderr[-3000:]  # no semaphore or shared block left behind
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def cpu_hog() -> Iterator[None]:
    """Two busy processes (this machine's cores) for as long as the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()  # process join: no zombie left behind


def check_against_adamw(first: dict, adamw: dict, precision: str) -> None:
    # the engine draws nothing from torch's RNG and leaves the default dtype alone: dropout saw what it sees under
    # plain AdamW at every step, the forward ran in the precision's dtype, the optimizer step in fp32
    assert first["rng"] == adamw["rng"]
    assert first["dtypes"] == adamw["dtypes"]
    assert first["default_dtype_after"] == adamw["default_dtype_after"] == "torch.float32"
    if precision == "bf16-true":
        assert first["dtypes"]["before_optimizer_step"] == ["torch.float32"]


@pytest.mark.parametrize("precision", ["bf16-true", pytest.param("32-true", marks=pytest.mark.slow)])
def test_two_fits_in_one_process_give_the_same_bits_and_rng_as_adamw(
    precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first fit builds its kernels (on the training thread), the second reuses them; both equal to the bit,
    and torch's RNG and default dtype at every step are plain AdamW's."""
    monkeypatch.setenv(KERNELS_ENV, "")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        first = determinism_script.fit(precision, steps=STEPS)
        second = determinism_script.fit(precision, steps=STEPS)
        adamw = determinism_script.fit(precision, strategy="auto", steps=STEPS)
    finally:
        torch.set_num_threads(threads)
    assert first["kernels"] == "compiled"
    assert second["weights"] == first["weights"]
    check_against_adamw(first, adamw, precision)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16-true", "32-true"])
def test_a_fit_gives_the_same_bits_on_every_run(precision: str, tmp_path: pathlib.Path) -> None:
    """Processes of their own: the first run builds every kernel into an empty compile cache; the second reads a warm
    cache beside a CPU hog (the lanes and the worker then run at other paces)."""
    first = run("--precision", precision, cache=tmp_path / "empty")
    assert first["kernels"] == "compiled"
    with cpu_hog():
        second = run("--precision", precision)
    assert second["weights"] == first["weights"]
    assert second["rng"] == first["rng"]
    adamw = run("--precision", precision, "--strategy", "auto")
    check_against_adamw(first, adamw, precision)
