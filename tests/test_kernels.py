"""The interim moves' kernels (``engine/kernels.py``): compiled equals eager, bf16's stochastic rounding keeps the
expectation and is reproducible, a missing compiler is handled as documented, and an engine with compiled kernels
trains as the eager one does (which ``test_engine_reference.py`` checks against the rule)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_zenflow import UnsupportedSetupError, ZenFlowConfig, ZenFlowEngine
from lightning_zenflow.engine import kernels as kernels_module
from lightning_zenflow.engine.kernels import KERNELS_ENV, Kernels, resolve_kernel_mode, stochastic_round_bf16

pytestmark = pytest.mark.usefixtures("no_leaked_children")

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(
    kernels_module.compiler_missing(CPU) is not None, reason="no C++ compiler for torch.compile on this machine"
)


@pytest.fixture(scope="module")
def compiled() -> Kernels:
    return Kernels("compiled", CPU)


def _inputs(rows: int, cols: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = (torch.rand(cols, generator=generator) > 0.2).float()
    return {
        "grad": torch.randn(rows, cols, generator=generator) * 1e-3,
        "weight": torch.randn(rows, cols, generator=generator) * 0.02,
        "row_scale": torch.rand(rows, generator=generator) + 0.5,
        "col_scale": torch.rand(cols, generator=generator) * 1e-3,
        "mask": mask,
    }


@needs_compiler
@pytest.mark.parametrize("shape", [(37, 11), (64, 48), (8, 40)], ids=str)  # tiles with a rest, whole tiles, no tiles
def test_compiled_sums_and_fp32_moves_equal_eager(compiled: Kernels, shape: tuple[int, int]) -> None:
    eager = Kernels("eager", CPU)
    x = _inputs(*shape)
    for got, expected in zip(compiled.row_col_sums(x["grad"], x["mask"]), eager.row_col_sums(x["grad"], x["mask"])):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)
    assert torch.equal(
        compiled.row_col_sums(x["grad"], x["mask"])[1][x["mask"] == 0],
        torch.zeros(0).new_zeros(int((x["mask"] == 0).sum())),
    )
    keep = torch.tensor(1.0)
    for keep_value in (None, keep):
        moved_c, moved_e = x["weight"].clone(), x["weight"].clone()
        args = (x["row_scale"], x["col_scale"], x["mask"], 1e-8, 1e-3, keep_value)
        compiled.moves_fp32_(x["grad"], moved_c, *args)
        eager.moves_fp32_(x["grad"], moved_e, *args)
        torch.testing.assert_close(moved_c, moved_e, rtol=0, atol=1e-9)
        assert torch.equal(moved_c[:, x["mask"] == 0], x["weight"][:, x["mask"] == 0])  # selected columns untouched
        assert (moved_c - x["weight"]).abs().max() > 0.5e-3  # clipped moves of size lr: something moved


@needs_compiler
def test_a_new_lr_or_shape_builds_no_new_kernel(compiled: Kernels) -> None:
    """One graph per function and dtype: an LR schedule or another matrix shape must not recompile (dynamo's limit
    of 8 would then silently fall back to slow code)."""
    counters = torch._dynamo.utils.counters["stats"]
    x = _inputs(40, 24)
    compiled.moves_fp32_(x["grad"], x["weight"], x["row_scale"], x["col_scale"], x["mask"], 1e-8, 1e-3, None)
    before = counters["unique_graphs"]
    for lr, shape in ((2e-3, (40, 24)), (3e-4, (96, 80)), (5e-5, (17, 130))):
        y = _inputs(*shape)
        compiled.moves_fp32_(y["grad"], y["weight"], y["row_scale"], y["col_scale"], y["mask"], 1e-7, lr, None)
    assert counters["unique_graphs"] == before


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


@needs_compiler
def test_compiled_bf16_moves_round_as_eager_ones(compiled: Kernels) -> None:
    eager = Kernels("eager", CPU)
    x = _inputs(48, 40, seed=3)
    grad, weight = x["grad"].bfloat16(), x["weight"].bfloat16()
    seed = torch.tensor(11, dtype=torch.int64)
    moved_c, moved_e = weight.clone(), weight.clone()
    args = (x["row_scale"], x["col_scale"], x["mask"], 1e-8, 1e-5, None, 0, seed)
    compiled.moves_bf16_(grad, moved_c, *args)
    eager.moves_bf16_(grad, moved_e, *args)
    # the fp32 sums may differ in their last bit, which can flip a rounding: at most one bf16 step, rarely
    step = (moved_e.float().abs() * 2**-7).clamp_min(1e-30)
    assert ((moved_c.float() - moved_e.float()).abs() <= step).all()
    assert (moved_c != moved_e).float().mean() < 0.01
    assert torch.equal(moved_c[:, x["mask"] == 0], weight[:, x["mask"] == 0])
    assert (moved_c != weight).any()  # moves of lr 1e-5 on weights ~0.02 (bf16 step ~1.2e-4) still move some


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
    monkeypatch.setattr(kernels_module, "compiler_missing", lambda device: "no C++ compiler on PATH (install g++)")
    monkeypatch.setattr(kernels_module, "_WARNED", set())
    with pytest.warns(UserWarning, match="run eagerly.*no C\\+\\+ compiler.*interim_kernel='eager'"):
        assert Kernels("auto", CPU).mode == "eager"
    with pytest.raises(UnsupportedSetupError, match="interim_kernel='compiled' needs torch.compile.*'eager'"):
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


def test_a_build_failure_under_auto_falls_back_to_eager(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(kernels_module, "compiler_missing", lambda device: None)

    def broken(fn, **_options):
        def call(*args):
            raise RuntimeError("C++ compile failed: the compiler crashed")

        return call

    monkeypatch.setattr(torch, "compile", broken)
    monkeypatch.setattr(kernels_module, "_COMPILED", {})
    kernels = Kernels("auto", CPU)
    x = _inputs(20, 10)
    expected = Kernels("eager", CPU).row_col_sums(x["grad"], x["mask"])
    with pytest.warns(UserWarning, match="torch.compile failed for row_col_sums.*eagerly"):
        got = kernels.row_col_sums(x["grad"], x["mask"])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    with pytest.raises(RuntimeError, match="the compiler crashed"):
        Kernels("compiled", CPU).row_col_sums(x["grad"], x["mask"])
    monkeypatch.setattr(kernels_module, "_COMPILED", {})


def _train(
    kernel: str, dtype: torch.dtype = torch.float32, steps: int = 14, host_state: str = "bf16"
) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 8)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    config = ZenFlowConfig(
        topk_ratio=0.25, update_interval=3, full_warm_up_rounds=2, interim_kernel=kernel, host_state=host_state
    )
    generator = torch.Generator().manual_seed(1)
    with ZenFlowEngine(opt, config, param_names={p: n for n, p in model.named_parameters()}) as engine:
        assert engine.interim is not None
        assert engine.interim.kernels.mode == kernel
        for _ in range(steps):
            x = torch.randn(16, 24, generator=generator).to(dtype)
            y = torch.randn(16, 8, generator=generator).to(dtype)
            engine.wait_for_update()
            nn.functional.mse_loss(model(x).float(), y.float()).backward()
            engine.step()
            opt.zero_grad()
        engine.flush()
    return {name: value.detach().float().clone() for name, value in model.state_dict().items()}


@needs_compiler
def test_an_engine_with_compiled_kernels_trains_as_the_eager_one() -> None:
    """The exact state: the moves and the host step compiled equal them eager to float rounding."""
    eager, compiled = _train("eager", host_state="fp32"), _train("compiled", host_state="fp32")
    for name, value in eager.items():
        torch.testing.assert_close(compiled[name], value, atol=1e-6, rtol=1e-5, msg=name)


@needs_compiler
def test_the_compact_state_trains_compiled_as_eager() -> None:
    """The compact state's stochastic roundings (the device's window sum, the host's second moment) compiled and
    eager: a compiled loop may compute a value one fp32 ulp apart (a fused multiply-add), which now and then flips a
    rounding by one bf16 step; the runs stay far closer to each other than to the untrained weights."""
    eager, compiled = _train("eager"), _train("compiled")
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 8)).state_dict()
    for name, value in eager.items():
        gap = (compiled[name] - value).abs().mean()
        trained = (value - initial[name].float()).abs().mean()
        assert gap < 0.05 * trained, (name, float(gap), float(trained))


@needs_compiler
def test_bf16_weights_train_with_compiled_moves_close_to_eager_ones() -> None:
    """bf16 weights with moves: both kernels give the same rule. A flipped rounding now and then (see above; a
    compiled reduction may also add in another order) is one bf16 step of one weight and then trains on: on average
    the runs stay far closer to each other than to the untrained weights."""
    eager, compiled = _train("eager", torch.bfloat16), _train("compiled", torch.bfloat16)
    torch.manual_seed(0)
    initial = nn.Sequential(nn.Linear(24, 40), nn.Tanh(), nn.Linear(40, 8)).to(torch.bfloat16).state_dict()
    for name, value in eager.items():
        gap = (compiled[name] - value).abs().mean()
        trained = (value - initial[name].float()).abs().mean()
        assert gap < 0.25 * trained, (name, float(gap), float(trained))


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
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=0)
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
    value = torch.randn(300, 200) * 0.02
    seed = torch.tensor(99, dtype=torch.int64)
    assert torch.equal(
        stochastic_round_bf16(value.to(cuda), 3, seed.to(cuda)).cpu(), stochastic_round_bf16(value, 3, seed)
    )
    compiled_round = torch.compile(stochastic_round_bf16, dynamic=True)
    assert torch.equal(compiled_round(value.to(cuda), 3, seed.to(cuda)).cpu(), stochastic_round_bf16(value, 3, seed))
