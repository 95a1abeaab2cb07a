"""The engine's kernels (``engine/kernels.py``, ``engine/host_step.py``) fused two ways: ``lightning_zenflow/native``
(a CPU's, the default) and ``torch.compile``'s ahead-of-time builds (``engine/compiled.py``: CUDA's way, here built
for the CPU with ``LIGHTNING_ZENFLOW_KERNELS=inductor``). Every elementwise kernel gives the eager function's bits
either way (so an eager fallback changes no number), the stochastic rounding is stochastic, keeps the expectation and
is reproducible, a build is made once per kind whatever the learning rate or the shape, lanes never build and nothing
touches the process's RNG or default dtype, a missing compiler or a failed build is handled as documented, and an
engine with fused kernels trains as the eager one does. The builds of ``torch.compile`` take seconds each with an
empty compile cache: one kind of each runs in the default tier, the rest in the slow tier."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_zenflow import UnsupportedSetupError, ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.engine import compiled as compiled_module
from lightning_zenflow.engine import kernels as kernels_module
from lightning_zenflow.engine.host_step import (
    NoiseTables,
    StepHyperParams,
    StepKernels,
    adam_master_step_,
    adam_step_,
    step_region,
)
from lightning_zenflow.engine.kernels import (
    AUTO_COMPILE_MIN_ELEMENTS,
    KERNELS_ENV,
    Kernels,
    resolve_kernel_mode,
    stochastic_round_bf16,
)
from lightning_zenflow.engine.notices import ZenFlowNotice
from lightning_zenflow.engine.rounding import PURPOSE_ACCUMULATE, bits_table, offset_of
from lightning_zenflow.native import native_kernels, native_unavailable

pytestmark = pytest.mark.usefixtures("no_leaked_children")

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    kernels_module.compiler_missing(CPU) is not None or compiled_module.aot_available() is not None,
    reason="no C++ compiler for torch.compile, or no ahead-of-time builds in this torch",
)
needs_native = pytest.mark.skipif(native_kernels() is None, reason=f"no native kernels: {native_unavailable()}")
SLOW = pytest.mark.slow  # torch.compile's builds (seconds each with an empty compile cache, as in CI)
BACKENDS = [pytest.param("native", marks=needs_native), pytest.param("inductor", marks=[needs_compiler, SLOW])]
"""The fused kernels' two builds: the native library, and torch.compile's (the CUDA path's way) in the slow tier."""


def _fused(backend: str) -> Kernels:
    """``interim_kernel="compiled"`` on the CPU: the native library, or (``"inductor"``) torch.compile's builds."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KERNELS_ENV, "inductor" if backend == "inductor" else "compiled")
        kernels = Kernels("compiled", CPU)
    assert (kernels.native is not None) == (backend == "native")
    return kernels


@pytest.fixture(scope="module", params=BACKENDS)
def fused(request: pytest.FixtureRequest) -> Kernels:
    return _fused(request.param)


@pytest.fixture(scope="module")
def compiled() -> Kernels:
    """torch.compile's builds on the CPU (the CUDA path's way of building)."""
    return _fused("inductor")


def _awkward(shape: tuple[int, ...], generator: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """Random values with the awkward ones mixed in: zeros, values exactly on the bf16 grid, tiny and large ones."""
    value = torch.randn(shape, generator=generator) * scale
    flat = value.view(-1)
    flat[::7] = 0.0
    flat[1::11] = flat[1::11].bfloat16().float()
    flat[2::13] *= 1e-30
    flat[3::17] *= 1e6
    return value


def _inputs(rows: int, cols: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(cols, generator=generator) > 0.2).float()
    return {
        "grad": _awkward((rows, cols), generator, 1e-3),
        "weight": _awkward((rows, cols), generator, 0.02),
        "row_scale": torch.rand(rows, generator=generator) + 0.5,
        "col_scale": torch.rand(cols, generator=generator) * 1e-3,
        "mask": mask,
    }


def _moves(dtype: torch.dtype, keep: bool) -> Callable[[Kernels, dict], list[torch.Tensor]]:
    def run(kernels: Kernels, x: dict) -> list[torch.Tensor]:
        device = x["grad"].device
        grad, weight = x["grad"].to(dtype), x["weight"].to(dtype).clone()
        keep_tensor = torch.tensor(1.0, device=device) if keep else None
        args = (x["row_scale"], x["col_scale"], x["mask"], 1e-8, 3e-4, keep_tensor)
        if dtype == torch.bfloat16:
            kernels.moves_bf16_(grad, weight, *args, 5, torch.tensor(11, dtype=torch.int64, device=device))
        else:
            kernels.moves_fp32_(grad, weight, *args)
        return [weight]

    return run


def _landing(dtype: torch.dtype) -> Callable[[Kernels, dict], list[torch.Tensor]]:
    def run(kernels: Kernels, x: dict) -> list[torch.Tensor]:
        weight = x["weight"].to(dtype).clone()
        seed = torch.tensor(5, dtype=torch.int64, device=weight.device)
        kernels.landing_add_(weight, x["grad"], 1.0 - 3e-4 * 0.1, 7, seed)
        return [weight]

    return run


def _window_sum(grad_dtype: torch.dtype, first: bool) -> Callable[[Kernels, dict], list[torch.Tensor]]:
    def run(kernels: Kernels, x: dict) -> list[torch.Tensor]:
        rows, cols = x["grad"].shape
        acc = x["weight"].bfloat16()
        device = x["grad"].device
        row_r, col_r = bits_table(3, 0, rows).to(device), bits_table(4, 0, cols).to(device)
        offset = torch.tensor(24576, dtype=torch.int32, device=device)
        kernels.accumulate_bf16_(acc, x["grad"].to(grad_dtype), row_r, col_r, offset, first)
        return [acc]

    return run


def _host_step(window: torch.dtype, state: torch.dtype, master: bool) -> Callable[[Kernels, dict], list[torch.Tensor]]:
    def run(kernels: Kernels | StepKernels, x: dict) -> list[torch.Tensor]:
        rows, cols = x["grad"].shape
        grad = (x["grad"] * 100).to(window)
        m = (x["weight"] * 0.1).to(state)
        v = (x["grad"].square() * 1e4 + x["row_scale"][:, None] * 1e-6).to(state)
        master2d = x["weight"].clone() if master else None
        hp = StepHyperParams(3e-4, 0.9, 0.999, 1e-8, 0.1, True, 3, 2.0)
        if isinstance(kernels, StepKernels):
            step_fn, master_fn = kernels.step_, kernels.master_step_
        else:
            step_fn, master_fn = kernels.wrap(adam_step_), kernels.wrap(adam_master_step_)
        step_region(step_fn, master_fn, grad, m, v, master2d, NoiseTables().of(7, 0, rows, cols), hp.scalars(7, master))
        return [grad, m, v] + ([master2d] if master else [])

    return run


ELEMENTWISE = {
    "moves fp32": _moves(torch.float32, keep=False),
    "moves fp32, keep": _moves(torch.float32, keep=True),
    "moves bf16": _moves(torch.bfloat16, keep=True),
    "landing fp32": _landing(torch.float32),
    "landing bf16": _landing(torch.bfloat16),
    "window sum, first, bf16 gradient": _window_sum(torch.bfloat16, first=True),
    "window sum, fp32 gradient": _window_sum(torch.float32, first=False),
    "window sum, bf16 gradient": _window_sum(torch.bfloat16, first=False),
    "host step, bf16 state": _host_step(torch.bfloat16, torch.bfloat16, master=False),
    "host step, fp32 state": _host_step(torch.float32, torch.float32, master=False),
    "host step, bf16 state, master": _host_step(torch.bfloat16, torch.bfloat16, master=True),
    "host step, fp32 state, master, fp32 window": _host_step(torch.float32, torch.float32, master=True),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
@pytest.mark.parametrize("shape", [(37, 11), (64, 48)], ids=str)
def test_every_elementwise_kernel_fused_gives_the_eager_bits(fused: Kernels, name: str, shape: tuple) -> None:
    """Bit for bit, awkward values included: a call that no build accepts runs eagerly and changes no number."""
    run = ELEMENTWISE[name]
    x = _inputs(*shape, seed=len(name))
    eager_calls = fused.eager_calls
    got, expected = run(fused, x), run(Kernels("eager", CPU), x)
    assert fused.eager_calls == eager_calls  # the fused kernels ran, not the eager fallback
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype
        assert torch.equal(_bits(a), _bits(b)), name


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """The bit patterns (NaNs and signed zeros compare as what they are)."""
    return tensor.view(torch.int16 if tensor.element_size() == 2 else torch.int32)


def test_the_fused_window_sum_rounds_stochastically(fused: Kernels) -> None:
    """A quarter of a bf16 step added at every step: rounded to nearest (what the compiled kernel did while inductor
    dropped the round trip) the sum would never leave 1.0; stochastically it keeps the expectation."""
    rows, cols = 200, 100
    acc = torch.ones(rows, cols, dtype=torch.bfloat16)
    quarter = torch.full((rows, cols), 2.0**-7 / 4.0)
    row_r, col_r = bits_table(1, 0, rows), bits_table(2, 0, cols)
    for step in range(8):
        offset = torch.tensor(offset_of(12345, PURPOSE_ACCUMULATE, step), dtype=torch.int32)
        fused.accumulate_bf16_(acc, quarter, row_r, col_r, offset, False)
    assert acc.float().mean().item() == pytest.approx(1.0 + 8 * 2.0**-7 / 4.0, rel=3e-4)


@pytest.mark.parametrize("shape", [(37, 11), (64, 48), (8, 40)], ids=str)
def test_fused_sums_equal_eager_to_rounding(fused: Kernels, shape: tuple[int, int]) -> None:
    """The statistics' sums add in another order when fused: equal to float rounding, exact zeros in the selected
    columns, and the same bits at every call."""
    eager = Kernels("eager", CPU)
    x = _inputs(*shape)
    got = fused.row_col_sums(x["grad"], x["mask"])
    for a, b in zip(got, eager.row_col_sums(x["grad"], x["mask"])):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    assert bool((got[1][x["mask"] == 0] == 0).all())
    again = fused.row_col_sums(x["grad"], x["mask"])
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@needs_compiler
@SLOW
def test_a_new_lr_or_shape_builds_nothing_new(compiled: Kernels) -> None:
    """One build per kernel and kind of call: a learning-rate schedule, another matrix shape or a row block at an
    offset runs the same build (and not eagerly)."""
    x = _inputs(40, 24)
    compiled.moves_fp32_(x["grad"], x["weight"], x["row_scale"], x["col_scale"], x["mask"], 1e-8, 1e-3, None)
    builds, eager_calls = len(compiled_module.BUILD_LOG.builds), compiled.eager_calls
    for lr, shape in ((2e-3, (40, 24)), (3e-4, (96, 80)), (5e-5, (17, 130))):
        y = _inputs(*shape)
        compiled.moves_fp32_(y["grad"], y["weight"], y["row_scale"], y["col_scale"], y["mask"], 1e-7, lr, None)
        rows = slice(3, shape[0] - 2)
        compiled.moves_fp32_(
            y["grad"][rows], y["weight"][rows], y["row_scale"][rows], y["col_scale"], y["mask"], 1e-7, lr, None
        )
    assert len(compiled_module.BUILD_LOG.builds) == builds
    assert compiled.eager_calls == eager_calls


@needs_compiler
@SLOW
def test_a_thread_that_does_not_own_the_builds_never_builds(compiled: Kernels) -> None:
    """A lane's call of a kind with no build runs eagerly (the same bits) and builds nothing; the owner's call builds;
    a reduction called on a lane before its build was prepared is refused (its eager sums round differently)."""
    kernels = _fused("inductor")
    x = _inputs(30, 20, seed=2)
    results = {}

    def lane() -> None:
        weight = x["weight"].clone()
        kernels.landing_add_(weight, x["grad"], 0.5, 0, torch.tensor(1))
        results["landed"] = weight
        try:
            kernels.row_col_sums(x["grad"], x["mask"])
        except RuntimeError as error:
            results["sums"] = str(error)

    thread = threading.Thread(target=lane)
    thread.start()
    thread.join()
    assert [function.kinds_built for function in kernels.functions] == [0] * len(kernels.functions)
    assert kernels.landing_add_.eager_calls == 1
    assert "runs before its build was prepared" in results["sums"]
    weight = x["weight"].clone()
    kernels.landing_add_(weight, x["grad"], 0.5, 0, torch.tensor(1))  # the owner (this thread) builds, then runs it
    assert kernels.landing_add_.kinds_built == 1
    assert kernels.landing_add_.eager_calls == 1
    assert torch.equal(weight, results["landed"])


def test_stochastic_rounding_keeps_the_expectation_and_is_reproducible() -> None:
    value = torch.full((400, 500), 1.0 + 1.0 / 512.0)  # a quarter of the way from 1.0 to the next bf16 value
    seed = torch.tensor(7, dtype=torch.int64)
    rounded = stochastic_round_bf16(value, 0, seed)
    assert set(rounded.float().unique().tolist()) == {1.0, 1.0078125}
    assert rounded.float().mean().item() == pytest.approx(1.0 + 1.0 / 512.0, abs=2e-5)  # ~13 sigma of the mean
    assert (-stochastic_round_bf16(-value, 0, seed).float()).mean().item() == pytest.approx(1.0 + 1.0 / 512.0, abs=2e-5)
    assert torch.equal(stochastic_round_bf16(value, 0, seed), rounded)
    assert not torch.equal(stochastic_round_bf16(value, 0, torch.tensor(8, dtype=torch.int64)), rounded)
    # the bits hash the global element index: rows 100.. of a matrix round as that matrix's rows do
    assert torch.equal(stochastic_round_bf16(value[100:], 100, seed), rounded[100:])
    exact = torch.tensor([[1.0, -2.5, 0.0078125]])
    assert torch.equal(stochastic_round_bf16(exact, 0, seed).float(), exact)  # bf16 values stay as they are


def test_bf16_moves_below_half_a_step_add_up_in_expectation() -> None:
    """A move of a quarter of a bf16 step, 8 times: rounding to nearest would leave the weights where they are;
    stochastic rounding moves them by two steps on average."""
    eager = Kernels("eager", CPU)
    rows, cols = 200, 100
    weight = torch.ones(rows, cols, dtype=torch.bfloat16)
    grad = torch.full((rows, cols), -1.0, dtype=torch.bfloat16)  # a ratio clipped to -1: move = +coefficient
    ones_r, ones_c = torch.ones(rows), torch.ones(cols)
    quarter = 2.0**-7 / 4.0
    for count in range(8):
        eager.moves_bf16_(grad, weight, ones_r, ones_c * 1e-6, ones_c, 0.0, quarter, None, 0, torch.tensor(count))
    assert weight.float().mean().item() == pytest.approx(1.0 + 8 * quarter, rel=2e-4)


def test_a_missing_compiler_warns_under_auto_and_is_refused_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels_module, "native_compiler_missing", lambda: "no C++ compiler on PATH (install g++)")
    monkeypatch.setattr(kernels_module, "_WARNED", set())
    with pytest.warns(UserWarning, match="run eagerly.*no C\\+\\+ compiler.*interim_kernel='eager'"):
        assert Kernels("auto", CPU, elements=AUTO_COMPILE_MIN_ELEMENTS).mode == "eager"
    with pytest.raises(UnsupportedSetupError, match="interim_kernel='compiled' needs its C\\+\\+ compiler.*'eager'"):
        Kernels("compiled", CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Kernels("eager", CPU).mode == "eager"  # chosen knowingly: no warning


def test_the_environment_overrides_auto_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "eager")
    assert resolve_kernel_mode("auto", CPU)[0] == "eager"
    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="LIGHTNING_ZENFLOW_KERNELS='fast'"):
        resolve_kernel_mode("auto", CPU)
    assert resolve_kernel_mode("eager", CPU)[0] == "eager"


@needs_compiler
def test_auto_builds_only_for_matrices_large_enough_to_repay_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a choice, not a shortcoming: no warning
        assert resolve_kernel_mode("auto", CPU, AUTO_COMPILE_MIN_ELEMENTS - 1) == ("eager", None)
    assert resolve_kernel_mode("auto", CPU, AUTO_COMPILE_MIN_ELEMENTS) == ("compiled", None)
    assert resolve_kernel_mode("compiled", CPU, 10) == ("compiled", None)  # asked for by name: built


def test_a_build_failure_runs_eagerly_under_auto_and_is_raised_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile's builds (the CUDA path's): a failed one runs its kernel eagerly under "auto", said once."""
    monkeypatch.setenv(KERNELS_ENV, "inductor")
    monkeypatch.setattr(kernels_module, "compiler_missing", lambda device: None)
    monkeypatch.setattr(compiled_module, "aot_available", lambda: None)
    monkeypatch.setattr(compiled_module, "_REGISTRY", {})

    def broken(fn: Callable, args: tuple) -> None:
        raise RuntimeError("C++ compile failed: the compiler crashed")

    monkeypatch.setattr(compiled_module, "_build", broken)
    kernels = Kernels("auto", CPU, elements=AUTO_COMPILE_MIN_ELEMENTS)
    assert kernels.mode == "compiled"
    x = _inputs(20, 10)
    expected = Kernels("eager", CPU).row_col_sums(x["grad"], x["mask"])
    with pytest.warns(ZenFlowNotice, match="could not build row_col_sums.*the compiler crashed.*runs eagerly"):
        got = kernels.row_col_sums(x["grad"], x["mask"])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(RuntimeError, match="the compiler crashed"):
        Kernels("compiled", CPU).row_col_sums(x["grad"], x["mask"])


@needs_compiler
@SLOW
def test_the_worker_step_runs_eagerly_until_its_build_is_ready_with_the_same_bits(monkeypatch) -> None:
    """The host worker builds its step on a thread of its own; an update meanwhile runs the eager step: both give the
    same bits, so the moment the build lands changes nothing (torch.compile's build; the native one is tested in
    tests/test_native.py and below)."""
    monkeypatch.setenv(KERNELS_ENV, "inductor")
    background = StepKernels("compiled", background=True)
    try:
        step = _host_step(torch.bfloat16, torch.bfloat16, master=False)
        x = _inputs(33, 21, seed=9)
        # before any build: the worker's thread runs the step eagerly
        before = step(background, x)
        assert background.kernels.eager_calls > 0
        window = torch.zeros(2, 3, dtype=torch.bfloat16)
        group = type("G", (), {"windows": (window,), "exp_avg": window, "master": None})()
        background.warm([group])
        background._idle.wait(600)  # thread wait: the builder thread's build
        calls = background.kernels.eager_calls
        after = step(background, x)
        assert background.kernels.eager_calls == calls  # the build ran
        assert all(torch.equal(a, b) for a, b in zip(before, after))
    finally:
        background.close()


def _train(
    kernel: str, dtype: torch.dtype = torch.float32, steps: int = 14, host_state: str = "bf16", **knobs: object
) -> dict[str, torch.Tensor]:
    """A short training run with ``interim_kernel=kernel`` (under the override the test set: native or inductor)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 8)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    config = ZenFlowConfig(
        topk_ratio=0.25,
        update_interval=3,
        full_warm_up_rounds=2,
        interim_kernel=kernel,
        host_state=host_state,
        **knobs,
    )
    generator = torch.Generator().manual_seed(1)
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in model.named_parameters()}) as engine:
        for _ in range(steps):
            x = torch.randn(16, 24, generator=generator).to(dtype)
            y = torch.randn(16, 8, generator=generator).to(dtype)
            engine.wait_for_update()
            nn.functional.mse_loss(model(x).float(), y.float()).backward()
            engine.step()
            opt.zero_grad()
        engine.flush()
        assert engine.kernels.mode == kernel
        assert engine.kernels.eager_calls == 0  # every lane call ran a fused kernel
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("host_state", "dtype"),
    [("bf16", torch.bfloat16), ("bf16", torch.float32), ("fp32", torch.bfloat16), ("fp32", torch.float32)],
    ids=[
        "bf16 state, bf16 weights",
        "bf16 state, fp32 weights",
        "fp32 state, bf16 weights",
        "fp32 state, fp32 weights",
    ],
)
def test_an_engine_without_interim_moves_trains_fused_bit_for_bit_as_eager(
    backend: str, host_state: str, dtype, monkeypatch
) -> None:
    eager = _train("eager", dtype, host_state=host_state, interim_step=0)
    monkeypatch.setenv(KERNELS_ENV, "inductor" if backend == "inductor" else "compiled")
    compiled = _train("compiled", dtype, host_state=host_state, interim_step=0)
    for name, value in eager.items():
        assert torch.equal(compiled[name], value), name


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32 weights", "bf16 weights"])
def test_an_engine_with_interim_moves_trains_fused_as_eager(backend: str, dtype: torch.dtype, monkeypatch) -> None:
    """With the moves, only the statistics' sums differ (their order of addition), now and then by one fp32 ulp,
    which flips a rounding: the runs stay far closer to each other than to the untrained weights."""
    eager = _train("eager", dtype)
    monkeypatch.setenv(KERNELS_ENV, "inductor" if backend == "inductor" else "compiled")
    compiled = _train("compiled", dtype)
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 8)).to(dtype).state_dict()
    for name, value in eager.items():
        gap = (compiled[name] - value).abs().mean()
        trained = (value - initial[name].float()).abs().mean()
        assert gap < 0.05 * trained, (name, float(gap), float(trained))


DEVICE_KERNELS = [name for name in ELEMENTWISE if not name.startswith("host step")]
"""The kernels that run on the device (the host step runs in the host worker, on the CPU)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", DEVICE_KERNELS)
def test_every_device_kernel_compiled_on_cuda_gives_the_eager_bits_on_cuda(name: str) -> None:
    """Triton's builds of the same functions, with eager's numerics asked for (``engine/compiled.py``: IEEE division,
    no flush of subnormals, the casts kept): bit for bit what eager CUDA computes, so an eager fallback on a GPU
    changes no number either."""
    cuda = torch.device("cuda")
    compiled_cuda, eager_cuda = Kernels("compiled", cuda), Kernels("eager", cuda)
    run = ELEMENTWISE[name]
    for shape in ((37, 11), (64, 48), (300, 257)):
        x = {key: value.to(cuda) for key, value in _inputs(*shape, seed=len(name)).items()}
        got, expected = run(compiled_cuda, x), run(eager_cuda, x)
        for a, b in zip(got, expected):
            assert torch.equal(_bits(a), _bits(b)), (name, shape)
    assert compiled_cuda.eager_calls == 0, "the builds ran, not the eager fallback"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernels_from_the_same_source_agree_with_the_cpu() -> None:
    """On CUDA the kernels are Triton's, built from the same functions: the sums and fp32 moves equal the CPU's to
    float rounding, and stochastic rounding draws bitwise the CPU's bits (the hash is integer arithmetic)."""
    cuda = torch.device("cuda")
    compiled_cuda, eager_cpu = Kernels("compiled", cuda), Kernels("eager", CPU)
    x = _inputs(70, 52, seed=5)
    on_cuda = {key: value.to(cuda) for key, value in x.items()}
    for got, expected in zip(
        compiled_cuda.row_col_sums(on_cuda["grad"], on_cuda["mask"]), eager_cpu.row_col_sums(x["grad"], x["mask"])
    ):
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-30)
    keep = torch.tensor(1.0)
    moved_cpu, moved_cuda = x["weight"].clone(), on_cuda["weight"].clone()
    eager_cpu.moves_fp32_(x["grad"], moved_cpu, x["row_scale"], x["col_scale"], x["mask"], 1e-8, 1e-3, keep)
    compiled_cuda.moves_fp32_(
        on_cuda["grad"],
        moved_cuda,
        on_cuda["row_scale"],
        on_cuda["col_scale"],
        on_cuda["mask"],
        1e-8,
        1e-3,
        keep.to(cuda),
    )
    torch.testing.assert_close(moved_cuda.cpu(), moved_cpu, rtol=0, atol=1e-8)
    assert compiled_cuda.eager_calls == 0
    value = torch.randn(300, 200) * 0.02
    seed = torch.tensor(99, dtype=torch.int64)
    assert torch.equal(
        stochastic_round_bf16(value.to(cuda), 3, seed.to(cuda)).cpu(), stochastic_round_bf16(value, 3, seed)
    )
