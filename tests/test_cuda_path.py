"""The CUDA path's pieces that a CPU can check: how kernels are built (the arguments the CUDA path gives them, the
build on torch 2.11, eager's numerics asked of Triton, nothing timed at a first call, builds not keyed on the CPU's
threads for CUDA), where pinning happens, and that what lane work reads is made and kept where CUDA needs it. Each
test fails on the code the CUDA review found (findings 1, 5-8); findings 2 and 3 are ``tests/test_lanes.py``'s strict
lanes, finding 4 is ``tests/test_gpu.py``'s rehearsal on the CPU (``tests/test_gpu_checks.py``)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from lightning_zenflow.engine import compiled as compiled_module
from lightning_zenflow.engine import kernels as kernels_module
from lightning_zenflow.engine import resources
from lightning_zenflow.engine.compiled import BUILD_OPTIONS, _kind_now, build_options, stand_ins
from lightning_zenflow.engine.kernels import KERNELS_ENV, Kernels, landing_add_
from lightning_zenflow.engine.landing import landing_call_like

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    kernels_module.compiler_missing(CPU) is not None or compiled_module.aot_available() is not None,
    reason="no C++ compiler for torch.compile, or no ahead-of-time builds in this torch",
)


# ------------------------------------------------------------------------------------- finding 1: the landing
def _stand_in_shapes(args: tuple) -> list[tuple[int, ...]]:
    return [tuple(a.shape) for a in stand_ins(args) if isinstance(a, torch.Tensor)]


def test_the_landing_is_built_with_a_step_shaped_like_the_weights_it_lands_in() -> None:
    """On CUDA the step comes from host memory and is staged up to the device, shaped like the weights' rows; the
    build was once given a ``[1, 1]`` stand-in for it, whose generic size differs from the weights' (the trace of
    ``w * scale + step`` then fails, on CUDA only). The arguments are made from the source's shape and dtype alone."""
    weights = torch.zeros(6, 5, dtype=torch.bfloat16)
    host_step = torch.zeros(6, 5)  # where it lives does not enter the arguments
    call = landing_call_like(weights, host_step.shape, host_step.dtype, 0.9, 3)
    weights_shape, step_shape, seed_shape = _stand_in_shapes(call)
    assert step_shape == weights_shape, "the build's step and weights must have equal sizes, as the lane's call has"
    assert seed_shape == ()
    assert call[1].dtype == torch.float32
    assert call[1].device == weights.device
    assert call[4].dtype == torch.int64
    # what the review found: a [1, 1] step beside [6, 5] weights gets sizes that cannot broadcast
    old = (weights, weights.new_empty((1, 1), dtype=torch.float32), 0.9, 3, weights.new_zeros((), dtype=torch.int64))
    assert _stand_in_shapes(old)[0] != _stand_in_shapes(old)[1]


@needs_compiler
def test_the_landing_built_as_the_cuda_path_builds_it_runs_the_lanes_call_with_eagers_bits(monkeypatch) -> None:
    monkeypatch.setenv(KERNELS_ENV, "inductor")  # torch.compile's build, as on CUDA (the CPU's are native otherwise)
    kernels = Kernels("compiled", CPU)
    weights = torch.randn(40, 24).bfloat16()
    step = torch.randn(40, 24) * 1e-3
    kernels.prepare(kernels.landing_add_, *landing_call_like(weights, step.shape, step.dtype, 0.97, 8))
    assert kernels.landing_add_.kinds_built == 1
    landed, expected = weights.clone(), weights.clone()
    seed = torch.tensor(7, dtype=torch.int64)
    kernels.landing_add_(landed, step, 0.97, 8, seed)
    landing_add_(expected, step, 0.97, 8, seed)
    assert kernels.landing_add_.eager_calls == 0, "the lane's call must run the build"
    assert torch.equal(landed.view(torch.int16), expected.view(torch.int16))


# --------------------------------------------------------------------------- findings 6-8: how builds are made
def test_builds_ask_for_eagers_numerics_and_time_nothing(monkeypatch) -> None:
    """Every option a build needs is set while it builds: IEEE division and subnormals on Triton (compiled and eager
    moves agree bitwise on CUDA), the casts kept, one launch configuration for a pointwise kernel and none chosen by
    timing for a reduction (no synchronisation, flush buffer or clone at a first call inside a lane)."""
    import torch._inductor.config as inductor_config

    seen = {}

    class FakeCompiled:
        def aot_compile(self, example):
            seen["division_rounding"] = inductor_config.eager_numerics.division_rounding
            seen["disable_ftz"] = inductor_config.eager_numerics.disable_ftz
            seen["emulate_precision_casts"] = inductor_config.emulate_precision_casts
            seen["autotune_pointwise"] = inductor_config.triton.autotune_pointwise
            seen["deterministic"] = inductor_config.deterministic
            return types.SimpleNamespace(guard_check=lambda *a: True, fn=lambda *a: None)

    monkeypatch.setattr(torch, "compile", lambda *a, **k: FakeCompiled())
    compiled_module._build(landing_add_, landing_call_like(torch.zeros(4, 3), torch.Size((4, 3)), torch.float32, 1, 0))
    assert seen == {
        "division_rounding": True,
        "disable_ftz": True,
        "emulate_precision_casts": True,
        "autotune_pointwise": False,
        "deterministic": True,
    }
    assert inductor_config.eager_numerics.division_rounding is False, "the options hold during the build only"
    assert set(build_options()) == set(BUILD_OPTIONS), "this torch knows every option"


@needs_compiler
def test_a_torch_without_aot_compile_on_torch_compile_still_builds_ahead_of_time(monkeypatch) -> None:
    """torch 2.11 (the GPU machine's) has dynamo's ahead-of-time build but does not expose it on the function
    ``torch.compile`` returns: the build goes through it directly, and the kernel still never compiles where it
    runs."""
    real_compile = torch.compile

    def without_aot(*args, **kwargs):
        compiled = real_compile(*args, **kwargs)

        def plain(*call_args, **call_kwargs):  # what torch 2.11's torch.compile(fn) returns: a plain function
            return compiled(*call_args, **call_kwargs)

        return plain

    monkeypatch.setattr(torch, "compile", without_aot)
    weights, step = torch.randn(16, 12), torch.randn(16, 12)
    built = compiled_module._build(landing_add_, landing_call_like(weights, step.shape, step.dtype, 0.5, 0))
    expected = weights.clone()
    landing_add_(expected, step, 0.5, 0, torch.tensor(1))
    assert built.guard_check(weights, step, 0.5, 0, torch.tensor(1))
    built.fn(weights, step, 0.5, 0, torch.tensor(1))
    assert torch.equal(weights, expected)


def test_a_cuda_build_is_not_keyed_on_the_cpus_thread_count() -> None:
    """A CPU build's parallel loops follow the thread count of its moment (a build per count); a CUDA kernel does
    not, and a CUDA run must not build again because a program changed ``torch.set_num_threads``."""
    meta_args = (torch.empty(3, 4, device="meta"), 0.5)
    cpu_args = (torch.empty(3, 4), 0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = (_kind_now(meta_args), _kind_now(cpu_args))
        torch.set_num_threads(2)
        two = (_kind_now(meta_args), _kind_now(cpu_args))
    finally:
        torch.set_num_threads(before)
    assert one[0] == two[0], "a non-CPU call's kind does not change with the thread count"
    assert one[1] != two[1], "a CPU call's kind does"


def test_the_window_sums_build_argument_is_made_once_per_device(monkeypatch) -> None:
    """The window sum's kernel is prepared with a 0-d stand-in of the lane's offset: made once per device, not a
    ``torch.zeros(2)`` allocated (and launched, on CUDA) for every matrix at every step."""
    from lightning_zenflow.engine.accumulate import DeviceAccumulation

    made = []
    real_zeros = torch.zeros

    def counting_zeros(*args, **kwargs):
        made.append(args)
        return real_zeros(*args, **kwargs)

    accumulation = DeviceAccumulation.__new__(DeviceAccumulation)
    accumulation._offset_like = {}
    prepared = []
    accumulation.kernels = types.SimpleNamespace(
        accumulate_bf16_=object(), prepare=lambda kernel, *args: prepared.append(args)
    )
    work = [(torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(3, 4), (torch.zeros(3), torch.zeros(4), 1))] * 5
    monkeypatch.setattr(torch, "zeros", counting_zeros)
    for _ in range(3):
        accumulation._prepare(work, first_in_window=False)
    assert len(made) == 1
    assert len(prepared) == 15
    assert all(args[4].dtype == torch.int32 and args[4].dim() == 0 for args in prepared)


# ---------------------------------------------------------------------------------------- finding 5: pinning
def test_pinning_and_unpinning_happen_on_the_engines_device(monkeypatch) -> None:
    """``cudaHostRegister`` on the current device creates a CUDA context there: on GPU 0 for every rank of a launch
    that did not call ``torch.cuda.set_device`` (about 0.5 GiB each). Every register and unregister call is made with
    the engine's device current."""
    current = ["cuda:0"]
    calls = []

    @contextlib.contextmanager
    def device(target):
        saved = current[0]
        current[0] = str(target)
        try:
            yield
        finally:
            current[0] = saved

    class FakeRuntime:
        def cudaHostRegister(self, pointer, nbytes, flags):
            calls.append(("register", current[0]))
            return 0

        def cudaHostUnregister(self, pointer):
            calls.append(("unregister", current[0]))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeRuntime())
    monkeypatch.setattr(torch.cuda, "device", device)
    engine_device = torch.device("cuda:3")
    pinned = resources.pin_rows([torch.zeros(8), torch.zeros(4)], engine_device)
    resources.unpin(pinned, engine_device)
    assert calls == [("register", "cuda:3")] * 2 + [("unregister", "cuda:3")] * 2
    assert current == ["cuda:0"]
