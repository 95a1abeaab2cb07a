"""The native CPU kernels (``lightning_zenflow/native``) against their eager definitions: every kernel and dtype
combination bit for bit equal (NaN where eager has NaN, any payload) on awkward values and odd shapes, in every
instruction-set variant this machine runs and on one and two threads through the pool; ``row_col_sums`` equal to
float rounding and the same bits for every thread count and variant; arguments the library cannot take refused by name;
a missing compiler or a failed build said once with the fix; two processes that start at once build once."""

from __future__ import annotations

import collections
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
import warnings
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import lightning_zenflow.native as native
from lightning_zenflow import ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.engine import device, notices
from lightning_zenflow.engine.host_step import NoiseTables, StepHyperParams, adam_master_step_, adam_step_
from lightning_zenflow.engine.kernels import accumulate_bf16_, landing_add_, moves_bf16_, moves_fp32_, row_col_sums
from lightning_zenflow.engine.notices import ZenFlowNotice
from lightning_zenflow.native import NativeArgumentError, native_kernels, native_unavailable, supported_variants
from lightning_zenflow.native.build import CACHE_ENV, variants

FP32, BF16 = torch.float32, torch.bfloat16
needs_library = pytest.mark.skipif(
    native_unavailable() is not None, reason=f"the native library is unavailable here: {native_unavailable()}"
)
VARIANTS = [
    pytest.param(
        name, marks=pytest.mark.skipif(name not in supported_variants(), reason=f"this CPU does not run {name}")
    )
    for name in native.VARIANTS
]
SHAPES = [(1, 1), (1, 37), (37, 1), (3, 17), (5, 33), (7, 100), (2, 257), (33, 300)]
"""Widths below, at and past a vector of 8, 16 and 32 lanes, one row, one column; plus a row-block view (``_views``)."""
SPECIALS = torch.tensor(
    [0.0, -0.0, 1e-45, -1e-45, 1e-40, -3e-39, 1.1754942e-38, -1.1754944e-38, 1.0, -1.0, 2.0, 0.5, 2.0**-20, 2.0**20]
    + [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-7), 3.3895314e38, 3.4028235e38, -3.4028235e38]
    + [float("inf"), float("-inf"), float("nan"), 1e-30, -1e30, 1e-38, 2.0**-126, 2.0**-133]
)
"""Signed zeros, subnormals (the largest too), powers of two, bf16 grid points and midpoints between them, the largest
bf16 and fp32, infinities, NaN, tiny and huge values."""
TABLES = NoiseTables()


def _awkward(shape: tuple[int, int], seed: int, scale: float) -> torch.Tensor:
    """fp32 ``randn * scale`` with a quarter of the elements replaced: specials, bf16 grid values, their midpoints."""
    return _awkward_values(shape, seed, scale).clone()


@functools.cache
def _awkward_values(shape: tuple[int, int], seed: int, scale: float) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    value = torch.randn(shape, generator=generator) * scale
    flat = value.view(-1)
    choice = torch.randint(0, 8, flat.shape, generator=generator)
    specials = SPECIALS[torch.randint(0, SPECIALS.numel(), flat.shape, generator=generator)]
    on_grid = flat.bfloat16().float()
    midpoint = (on_grid.view(torch.int32) + 0x8000).view(torch.float32)  # halfway to the next bf16
    flat.copy_(torch.where(choice == 0, specials, flat))
    flat.copy_(torch.where(choice == 1, on_grid, flat))
    flat.copy_(torch.where(choice == 2, midpoint, flat))
    return value


def _view(tensor: torch.Tensor, k: int) -> torch.Tensor:
    """``tensor`` copied into a row-block view at an offset into a larger matrix (row stride past the width): what the
    engine passes for a block of a region."""
    rows, cols = tensor.shape
    return torch.empty(rows + 3, cols + 5 + k, dtype=tensor.dtype)[2 : 2 + rows, 3 + k : 3 + k + cols].copy_(tensor)


def _same_bits(expected: torch.Tensor, got: torch.Tensor, what: str) -> None:
    """Bitwise equal where eager is not NaN (signed zeros, subnormals, infinities included); NaN where it is NaN."""
    assert expected.dtype == got.dtype, what
    assert expected.shape == got.shape, what
    a, b = expected.float(), got.float()
    nan = a.isnan()
    assert torch.equal(nan, b.isnan()), f"{what}: NaN at different places"
    differ = (a.view(torch.int32) != b.view(torch.int32)) & ~nan
    if differ.any():
        index = differ.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(differ.sum())} elements differ, first at {index}: eager {a[tuple(index)].item()!r}, native "
            f"{b[tuple(index)].item()!r}"
        )


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """1, or 2 with tiles of 64 elements and no size threshold: every call goes through the pool in many tiles."""
    if request.param > 1:
        native._set_limits(64, 0, 1 << 16, 4096)
    yield request.param
    native._set_limits(1 << 16, 1 << 17, 1 << 16, 4096)


# -------------------------------------------------------------------------------------- the elementwise kernels
def _case(kernel: str, combo: tuple, shape: tuple[int, int], view: bool) -> tuple[dict, Callable]:
    """The inputs of one call and the call itself (``fn(kernels, inputs)``, ``kernels`` None for eager)."""
    rows, cols = shape
    seed = zlib.crc32(f"{_case_id((kernel, combo))} {shape} {view}".encode()) % 2**31  # the same inputs every run
    if kernel == "adam":
        grad_dtype, state_dtype, master, stochastic, hp_index = combo
        hp = [
            StepHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.1, True, 3, 2.0),
            StepHyperParams(3e-4, 0.8, 0.95, 0.0, 0.01, False, 1, 3.0),
        ][hp_index]
        inputs = {
            "grad2d": _awkward(shape, seed, 1e-3).to(grad_dtype),
            "exp_avg2d": _awkward(shape, seed + 1, 1e-4).to(state_dtype),
            "exp_avg_sq2d": _awkward(shape, seed + 2, 1e-6).abs().to(state_dtype),
        }
        if master:
            inputs = {"master2d": _awkward(shape, seed + 3, 0.02), **inputs}
        row_r, col_r = TABLES.of(seed % 1000, 7, rows, cols)
        constants = (row_r, col_r, hp.scalars(seed % 1000, master), stochastic)

        def call(kernels, x):
            fn = (kernels.adam_master_step_ if master else kernels.adam_step_) if kernels else None
            fn = fn or (adam_master_step_ if master else adam_step_)
            fn(*x.values(), *constants)

    elif kernel in ("moves_fp32_", "moves_bf16_"):
        grad_dtype, weight_dtype, keep = combo
        generator = torch.Generator().manual_seed(seed)
        inputs = {"grad2d": _awkward(shape, seed, 1e-3).to(grad_dtype), "weight2d": _awkward(shape, seed + 1, 0.02)}
        inputs["weight2d"] = inputs["weight2d"].to(weight_dtype)
        row_scale = torch.rand(rows, generator=generator) + 0.5
        col_scale = torch.rand(cols, generator=generator) * 1e-3
        col_scale[::5] = 0.0  # 0 / (0 + eps), and 0 / 0 with eps 0 below
        mask = (torch.rand(cols, generator=generator) > 0.2).float()
        eps, coefficient = (1e-8, 3e-4) if seed % 2 else (0.0, 1e-3)
        arguments = (row_scale, col_scale, mask, eps, coefficient, keep)
        extra = (70001 if seed % 3 else 5, torch.tensor(2**33 + 11 + seed % 7)) if kernel == "moves_bf16_" else ()

        def call(kernels, x):
            fn = (
                getattr(kernels, kernel)
                if kernels
                else {"moves_fp32_": moves_fp32_, "moves_bf16_": moves_bf16_}[kernel]
            )
            fn(*x.values(), *arguments, *extra)

    elif kernel == "landing_add_":
        weight_dtype, step_dtype, scale = combo
        inputs = {
            "weight2d": _awkward(shape, seed, 0.02).to(weight_dtype),
            "step2d": _awkward(shape, seed + 1, 1e-3).to(step_dtype),
        }

        def call(kernels, x):
            (kernels.landing_add_ if kernels else landing_add_)(*x.values(), scale, 9, torch.tensor(5 + seed % 3))

    elif kernel == "accumulate_bf16_":
        acc_dtype, grad_dtype, first, offset = combo
        inputs = {"acc2d": _awkward(shape, seed, 1e-2).to(acc_dtype), "grad2d": _awkward(shape, seed + 1, 1e-3)}
        inputs["grad2d"] = inputs["grad2d"].to(grad_dtype)
        row_r, col_r = TABLES.of(seed % 1000, 3, rows, cols)

        def call(kernels, x):
            (kernels.accumulate_bf16_ if kernels else accumulate_bf16_)(*x.values(), row_r, col_r, offset, first)

    elif kernel in ("gather_columns", "write_columns"):
        matrix_dtype, share = combo
        generator = torch.Generator().manual_seed(seed)
        k = max(1, round(share * cols))  # the first and the last column included now and then
        selected = torch.randperm(cols, generator=generator)[:k].sort().values
        packed = _awkward((rows, k), seed + 1, 0.02)
        if kernel == "gather_columns":
            inputs = {"grad2d": _awkward(shape, seed, 1e-3).to(matrix_dtype), "out": packed.fill_(7.0)}
        else:
            inputs = {"weight2d": _awkward(shape, seed, 0.02).to(matrix_dtype), "master": packed}

        def call(kernels, x):
            matrix, packed = x.values()
            (getattr(kernels, kernel) if kernels else getattr(device, kernel))(matrix, selected, packed)

    else:
        raise ValueError(kernel)
    if view:
        inputs = {name: _view(tensor, k) for k, (name, tensor) in enumerate(inputs.items())}
    return inputs, call


@functools.cache
def _eager(kernel: str, combo: tuple, shape: tuple[int, int], view: bool) -> dict:
    inputs, call = _case(kernel, combo, shape, view)
    outputs = {name: tensor.clone() for name, tensor in inputs.items()}
    call(None, outputs)
    return outputs


CASES = (
    [("adam", (g, s, m, st, h)) for g in (FP32, BF16) for s in (FP32, BF16) for m in (False, True)
     for st in (False, True) for h in ((0, 1) if (g, s, m, st) == (BF16, BF16, False, True) else (0,))]
    + [(k, (g, w, keep)) for k in ("moves_fp32_", "moves_bf16_") for g in (FP32, BF16) for w in (FP32, BF16)
       for keep in (None, torch.tensor(1.0), torch.tensor(0.0), torch.tensor(0.5, dtype=torch.float64))]
    + [("landing_add_", (w, s, scale)) for w in (FP32, BF16) for s in (FP32, BF16) for scale in (1.0 - 3e-5, 0.5)]
    + [("accumulate_bf16_", (a, g, first, off)) for a in (BF16, FP32) for g in (FP32, BF16) for first in (False, True)
       for off in ((torch.tensor(24576, dtype=torch.int32), 70000, torch.tensor(3.0)) if a == BF16 and g == FP32
                   else (torch.tensor(24577, dtype=torch.int64),))]
    + [(k, (m, share)) for k in ("gather_columns", "write_columns") for m in (FP32, BF16) for share in (0.1, 0.5, 1.0)]
)  # fmt: skip


def _case_id(case: tuple) -> str:
    kernel, combo = case

    def name(part: object) -> str:
        if isinstance(part, torch.dtype):
            return {FP32: "fp32", BF16: "bf16"}[part]
        if isinstance(part, torch.Tensor):
            return f"{str(part.dtype).removeprefix('torch.')}({part.item():g})"
        return repr(part)

    return f"{kernel}[{','.join(name(part) for part in combo)}]"


@needs_library
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_every_kernel_gives_the_eager_bits(variant: str, threads: int, case: tuple) -> None:
    kernels = native_kernels(variant)
    kernel, combo = case
    for shape in SHAPES:
        for view in (False, True) if shape == (33, 300) else (False,):
            inputs, call = _case(kernel, combo, shape, view)
            call(_Threads(kernels, threads), inputs)
            for name, expected in _eager(kernel, combo, shape, view).items():
                _same_bits(expected, inputs[name], f"{variant}, {threads} thread(s), {shape}, view={view}: {name}")


class _Threads:
    """A kernels object whose calls pass ``threads``."""

    def __init__(self, kernels: native.NativeKernels, threads: int) -> None:
        self.kernels, self.threads = kernels, threads

    def __getattr__(self, name: str) -> Callable:
        return functools.partial(getattr(self.kernels, name), threads=self.threads)


@needs_library
def test_the_comparison_sees_a_single_wrong_bit() -> None:
    expected = torch.tensor([1.0, -0.0, float("nan")])
    _same_bits(expected, expected.clone(), "identical")
    with pytest.raises(AssertionError, match="1 elements differ"):
        _same_bits(expected, torch.tensor([1.0, 0.0, float("nan")]), "signed zero")
    with pytest.raises(AssertionError, match="NaN"):
        _same_bits(expected, torch.tensor([1.0, -0.0, 1.0]), "NaN")


# -------------------------------------------------------------------------------------- the statistics' sums
@needs_library
@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_row_col_sums_equal_eager_and_never_depend_on_threads_or_variant(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    for shape, limits in [
        ((1, 1), None),
        ((37, 1), None),
        ((5, 33), None),
        ((300, 70), (1024, 32)),
        ((130, 4100), None),
    ]:
        grad = (torch.randn(shape, generator=generator) * torch.rand(shape[1], generator=generator) * 10).to(dtype)
        mask = (torch.rand(shape[1], generator=generator) > 0.3).float()
        grad[:, 0] = float("inf") if shape[1] > 2 else grad[:, 0]  # a host column with inf: NaN where eager has NaN
        mask[0] = 0.0
        expected = row_col_sums(grad, mask)
        results = []
        try:
            if limits is not None:  # blocks of 32 rows... and spans of 32 columns: the partial sums' combination
                native._set_limits(64, 0, *limits)
            for variant in supported_variants():
                for threads in (1, 2, 3):
                    results.append(native_kernels(variant).row_col_sums(grad, mask, threads=threads))
        finally:
            native._set_limits(1 << 16, 1 << 17, 1 << 16, 4096)
        for got in results:
            for a, b in zip(results[0], got):
                assert torch.equal(a.view(torch.int32), b.view(torch.int32)), shape
        for e, g in zip(expected, results[0]):
            assert torch.allclose(e, g, rtol=1e-5, atol=0, equal_nan=True), shape
        if shape[1] > 2:
            finite_masked = (mask == 0) & (grad.float().isfinite().all(0))
            assert (results[0][1][finite_masked].view(torch.int32) == 0).all()  # +0.0 exactly


# -------------------------------------------------------------------------------------- what the library refuses
@needs_library
def test_arguments_it_cannot_take_are_refused_by_name() -> None:
    kernels = native_kernels()
    grad, m, v = torch.zeros(4, 6), torch.zeros(4, 6), torch.zeros(4, 6)
    row_r, col_r = NoiseTables().of(0, 0, 4, 6)
    scalars = StepHyperParams(1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1, 1.0).scalars(0, False)
    with pytest.raises(NativeArgumentError, match="grad2d has strides .* rows must be contiguous"):
        kernels.adam_step_(torch.zeros(6, 4).t(), m, v, row_r, col_r, scalars, False)
    with pytest.raises(NativeArgumentError, match="exp_avg2d is on meta"):
        kernels.adam_step_(grad, m.to("meta"), v, row_r, col_r, scalars, False)
    with pytest.raises(NativeArgumentError, match="float16; the native kernels take float32 or bfloat16"):
        kernels.adam_step_(grad.half(), m, v, row_r, col_r, scalars, False)
    with pytest.raises(NativeArgumentError, match="moments of one dtype"):
        kernels.adam_step_(grad, m.bfloat16(), v, row_r, col_r, scalars, True)
    with pytest.raises(NativeArgumentError, match=r"col_r is torch.int64 .*\[6\] torch.int32"):
        kernels.adam_step_(grad, m, v, row_r, col_r.long(), scalars, True)
    with pytest.raises(NativeArgumentError, match=r"exp_avg_sq2d has shape \(4, 5\)"):
        kernels.adam_step_(grad, m, v[:, :5], row_r, col_r, scalars, False)
    with pytest.raises(NativeArgumentError, match="weight2d is written but its rows overlap"):
        kernels.landing_add_(torch.zeros(1, 6).expand(4, 6), grad, 1.0, 0, torch.tensor(0))
    selected, packed = torch.tensor([0, 5]), torch.zeros(4, 2)
    with pytest.raises(NativeArgumentError, match="selected must be a CPU int64 tensor"):
        kernels.gather_columns(grad, selected.int(), packed)
    with pytest.raises(NativeArgumentError, match=r"out has shape \(4, 3\)"):
        kernels.gather_columns(grad, selected, torch.zeros(4, 3))
    with pytest.raises(NativeArgumentError, match="master is bfloat16: the native kernel packs the columns in fp32"):
        kernels.write_columns(m, selected, packed.bfloat16())
    with pytest.raises(IndexError, match="column index is out of range"):
        kernels.write_columns(m, torch.tensor([0, 6]), packed + 1)
    assert not m.any()  # refused before any row was written
    with pytest.raises(NativeArgumentError, match="keep must be None or a one-element CPU tensor"):
        kernels.moves_fp32_(grad, m, torch.ones(4), torch.ones(6), torch.ones(6), 1e-8, 1e-3, torch.ones(2))
    # what it takes that the engine does not pass: a bool mask (0 and 1, as eager promotes it), strided tables
    kernels.moves_fp32_(grad, m, torch.ones(8)[::2], torch.ones(6), torch.ones(6, dtype=torch.bool), 1e-8, 1e-3, None)
    kernels.adam_step_(torch.zeros(0, 6), torch.zeros(0, 6), torch.zeros(0, 6), row_r[:0], col_r, scalars, True)


# -------------------------------------------------------------------------------------- in the engine
def _train(kernel: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A short run of the CPU stand-in without interim moves (their statistics' sums add in another order natively):
    landings, two refreshes, and a resume from a state dict halfway (the loaded masters are written back into the
    weights' selected columns)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 8)).to(dtype)
    config = ZenFlowConfig(
        topk_ratio=0.25, update_interval=3, full_warm_up_rounds=2, select_strategy="step", select_interval=3,
        interim_step=0, interim_kernel=kernel,
    )  # fmt: skip
    names = {param: name for name, param in model.named_parameters()}
    generator = torch.Generator().manual_seed(1)
    state = None
    for steps in (7, 7):
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
        with ZenFlowEngine(optimizer, config, param_names=names) as engine:
            if state is not None:
                engine.load_state_dict(state)
            for _ in range(steps):
                engine.wait_for_update()
                x, y = torch.randn(16, 24, generator=generator), torch.randn(16, 8, generator=generator)
                torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
                engine.step()
                optimizer.zero_grad()
            state = engine.state_dict()
            assert engine.kernels.eager_calls == 0
    assert state["progress"]["selections"] == 4, state["progress"]  # after the warm-up, then a refresh every window
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


@needs_library
@pytest.mark.parametrize("dtype", [FP32, BF16], ids=["fp32 weights", "bf16 weights"])
def test_the_engine_moves_the_selected_columns_natively_with_the_eager_bits(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``interim_kernel="compiled"`` the stand-in's device update gathers the selected gradient columns and
    writes the masters back with the native kernels (eagerly: torch's ``index_select`` and ``index_copy_``), and the
    weights are the eager run's bit for bit."""
    calls: collections.Counter = collections.Counter()

    def counted(name: str) -> Callable:
        original = getattr(native.NativeKernels, name)

        def call(self, *args, **kwargs):
            calls[name] += 1
            return original(self, *args, **kwargs)

        return call

    for name in ("gather_columns", "write_columns"):
        monkeypatch.setattr(native.NativeKernels, name, counted(name))
    eager = _train("eager", dtype)
    assert not calls
    compiled = _train("compiled", dtype)
    assert calls["gather_columns"] >= 10, calls
    assert calls["write_columns"] >= 10, calls
    for name, value in eager.items():
        _same_bits(value, compiled[name], name)


@needs_library
def test_a_forked_child_gets_the_same_bits_and_never_waits_for_its_parents_workers() -> None:
    """The parent's pool workers do not exist in a forked child (the child starts a pool of its own, and a seat no
    worker takes is closed when the caller has run every tile): its threaded call ends, with the eager bits."""
    kernels = native_kernels()
    inputs, call = _case("adam", (BF16, BF16, False, True, 0), (33, 300), False)
    expected = _eager("adam", (BF16, BF16, False, True, 0), (33, 300), False)
    native._set_limits(64, 0, 1 << 16, 4096)
    try:
        call(_Threads(kernels, 2), {name: t.clone() for name, t in inputs.items()})  # the parent's pool is running
        pid = os.fork()
        if pid == 0:  # the child: exit 0 when its threaded call gave the eager bits
            try:
                call(_Threads(kernels, 2), inputs)
                for name, tensor in inputs.items():
                    _same_bits(expected[name], tensor, name)
            except BaseException:
                os._exit(1)
            os._exit(0)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:  # process wait, polled: a hung child fails the test
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung in the native kernel's pool")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(done[1]) == 0
    finally:
        native._set_limits(1 << 16, 1 << 17, 1 << 16, 4096)


# -------------------------------------------------------------------------------------- availability and the build
@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch):
    """The module forgets the loaded library and the notices said (restored afterwards)."""
    monkeypatch.setattr(notices, "_SAID", set())
    native._reset_for_tests()
    yield
    native._reset_for_tests()


def test_a_missing_compiler_is_said_once_with_the_fix(fresh_library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "find_compiler", lambda: None)
    with pytest.warns(ZenFlowNotice, match=r"no C\+\+ compiler.*eager kernels instead.*apt-get install g\+\+"):
        assert native_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_kernels() is None  # said once
    assert "no C++ compiler" in native_unavailable()
    assert supported_variants() == ()


def test_a_failed_build_is_said_once_with_the_compiler_output(
    fresh_library, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-g++"
    broken.write_text("#!/bin/sh\necho 'zenflow_cpu.cpp:1: error: this compiler is broken' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    with pytest.warns(
        ZenFlowNotice, match="(?s)build with .*broken-g.. failed.*this compiler is broken.*LIGHTNING_ZENFLOW_NATIVE=0"
    ):
        assert native_kernels() is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_kernels() is None


def test_the_switch_turns_them_off_silently(fresh_library, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.NATIVE_ENV, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native_kernels() is None
    assert native.NATIVE_ENV in native_unavailable()


@needs_library
def test_a_variant_this_machine_cannot_run_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown native variant 'sse9'"):
        native_kernels("sse9")
    monkeypatch.setenv(native.VARIANT_ENV, "portable")
    assert native_kernels().variant == "portable"


FAKE_COMPILER = """#!/bin/sh
echo "$@" >> "{log}"
case "$*" in *--version*) echo "fake c++ 1.0"; exit 0;; esac
eval out=\\${{$#}}
sleep 0.3
case "$*" in *-shared*) cp "{library}" "$out";; *) : > "$out";; esac
"""


@needs_library
def test_two_processes_that_start_at_once_build_once(tmp_path: Path) -> None:
    """A compiler that logs its calls (and links by copying the real library): one process compiles and links, the
    other waits for the lock and finds what the first built. The processes run ``build.py`` alone (it imports the
    standard library only), so they start in milliseconds, at once."""
    log = tmp_path / "calls.log"
    compiler = tmp_path / "fake-c++"
    compiler.write_text(FAKE_COMPILER.format(log=log, library=native_kernels().path))
    compiler.chmod(0o755)
    env = {**os.environ, "CXX": str(compiler), CACHE_ENV: str(tmp_path / "cache")}
    script = textwrap.dedent(f"""
        import importlib.util
        spec = importlib.util.spec_from_file_location("build", {str(Path(native.build.__file__))!r})
        build = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(build)
        path, seconds = build.ensure_built(build.find_compiler())
        print(seconds is not None, path)
    """)
    processes = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0].split() for p in processes]  # process wait: each finds the library
    assert all(p.returncode == 0 for p in processes), outputs
    assert sorted(built for built, _ in outputs) == ["False", "True"]
    assert outputs[0][1] == outputs[1][1]
    calls = log.read_text().splitlines()
    assert sum("-shared" in call for call in calls) == 1
    assert sum(" -c " in call for call in calls) == len(variants())
