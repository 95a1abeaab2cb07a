"""Tests of the parameter layout, the shared host buffers and the column selection (engine/layout.py, selection.py)."""

from __future__ import annotations

import pytest
import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine import ZenFlowEngine
from lightning_zenflow.engine.layout import (
    HostFormat,
    allocate_host_buffers,
    allocate_window_rows,
    build_layout,
    staging_view,
)
from lightning_zenflow.engine.selection import (
    column_scores,
    complement,
    diagnose,
    select_columns,
    top_columns,
)

pytestmark = pytest.mark.usefixtures("no_leaked_children")


class Mixed(torch.nn.Module):
    """Matrices (linear, conv), ≤1-D parameters (biases, a norm) and a frozen linear."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(6, 4)  # weight [4, 6]
        self.conv = torch.nn.Conv2d(3, 5, kernel_size=(2, 3))  # weight [5, 3, 2, 3] -> [5, 18]
        self.norm = torch.nn.LayerNorm(4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = torch.nn.Linear(4, 2, bias=False)  # weight [2, 4]


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------------- layout
def test_build_layout_splits_matrices_device_only_and_frozen():
    torch.manual_seed(0)
    model = Mixed()
    (group,) = build_layout([{"params": list(model.parameters())}], _names(model))
    assert [s.name for s in group.matrices] == ["linear.weight", "conv.weight", "head.weight"]
    assert [s.name for s in group.device_only] == ["linear.bias", "conv.bias", "norm.weight", "norm.bias"]
    every_name = {s.name for s in group.matrices} | {s.name for s in group.device_only}
    assert not any(name.startswith("frozen.") for name in every_name)
    shapes = {s.name: (s.rows, s.cols) for s in group.matrices}
    assert shapes == {"linear.weight": (4, 6), "conv.weight": (5, 18), "head.weight": (2, 4)}
    assert [s.index_in_group for s in group.matrices] == [0, 1, 2]
    assert group.host_numel == 24 + 90 + 8


def test_conv_weight_columns_are_flattened_input_positions():
    torch.manual_seed(0)
    model = Mixed()
    (group,) = build_layout([{"params": list(model.parameters())}], _names(model))
    (host,) = allocate_host_buffers([group], HostFormat.resolve("fp32", master=True, accumulate_on="device"))
    conv_slot = group.matrices[1]
    conv2d = conv_slot.view2d(host.master)
    weight = model.conv.weight.detach()
    assert conv2d.shape == (5, 18)
    # column j of [out, in*kh*kw] is input channel j // 6 at kernel position ((j % 6) // 3, j % 3)
    for channel, kh, kw in [(0, 0, 0), (1, 1, 2), (2, 0, 1)]:
        column = channel * 6 + kh * 3 + kw
        assert torch.equal(conv2d[:, column], weight[:, channel, kh, kw])


def test_offsets_are_contiguous_per_group():
    model = Mixed()
    extra = torch.nn.Linear(3, 7)
    groups = [
        {"params": [model.linear.weight, model.linear.bias, model.conv.weight, model.head.weight]},
        {"params": [model.norm.weight, extra.weight, model.conv.bias, model.frozen.weight]},
    ]
    first, second = build_layout(groups)
    assert [(s.offset, s.numel) for s in first.matrices] == [(0, 24), (24, 90), (114, 8)]
    assert first.host_numel == 122
    # a new group starts at offset 0 again; frozen params take no room
    assert [(s.offset, s.numel) for s in second.matrices] == [(0, 21)]
    assert [s.group_index for s in second.matrices + second.device_only] == [1, 1, 1]
    # without names, a parameter is named by its position
    assert first.matrices[0].name == "group0.param0"
    assert second.matrices[0].name == "group1.param1"


def test_duplicate_parameter_is_refused():
    model = Mixed()
    groups = [{"params": [model.linear.weight]}, {"params": [model.head.weight, model.linear.weight]}]
    with pytest.raises(ValueError) as error:
        build_layout(groups, _names(model))
    assert "linear.weight appears twice" in str(error.value)
    assert "pass each parameter once" in str(error.value)


def test_non_contiguous_matrix_is_refused():
    transposed = torch.nn.Parameter(torch.randn(6, 4).t())
    assert not transposed.is_contiguous()
    with pytest.raises(ValueError) as error:
        build_layout([{"params": [transposed]}], {id(transposed): "proj.weight"})
    assert "proj.weight is not contiguous" in str(error.value)
    assert ".contiguous()" in str(error.value)


def test_integer_tensor_cannot_train_and_is_ignored_as_frozen():
    # torch itself forbids requires_grad on an integer tensor, so an integer "parameter" is always frozen
    with pytest.raises(RuntimeError):
        torch.zeros(3, 3, dtype=torch.long).requires_grad_(True)
    counts = torch.zeros(3, 3, dtype=torch.long)
    weight = torch.nn.Parameter(torch.randn(3, 3))
    (group,) = build_layout([{"params": [counts, weight]}])
    assert [s.param for s in group.matrices] == [weight]
    assert group.device_only == []


def test_non_floating_trainable_parameter_is_a_type_error():
    # the only trainable non-floating dtypes are complex ones
    complex_weight = torch.nn.Parameter(torch.randn(3, 3, dtype=torch.complex64))
    with pytest.raises(TypeError) as error:
        build_layout([{"params": [complex_weight]}], {id(complex_weight): "rotary.weight"})
    assert "rotary.weight has dtype torch.complex64" in str(error.value)
    assert "floating-point" in str(error.value)


def test_non_tensor_in_param_group_is_a_type_error():
    with pytest.raises(TypeError, match="param group 0 holds a str"):
        build_layout([{"params": ["weight"]}])


# ------------------------------------------------------------------------------------------------ host buffers
@pytest.mark.parametrize(
    ("host_state", "master", "accumulate_on", "moments", "window", "per_element"),
    [
        ("bf16", False, "device", torch.bfloat16, torch.bfloat16, 6),
        ("bf16", True, "device", torch.bfloat16, torch.bfloat16, 10),
        ("fp32", False, "device", torch.float32, torch.float32, 12),
        ("fp32", True, "device", torch.float32, torch.float32, 16),
        ("bf16", False, "host", torch.bfloat16, torch.float32, 12),
        ("fp32", True, "host", torch.float32, torch.float32, 20),
    ],
)
def test_allocate_host_buffers_in_each_format(host_state, master, accumulate_on, moments, window, per_element):
    torch.manual_seed(0)
    bf16_weight = torch.nn.Parameter(torch.randn(3, 5).to(torch.bfloat16))
    model = Mixed()
    groups = [{"params": list(model.parameters())}, {"params": [bf16_weight]}]
    layout = build_layout(groups, _names(model))
    host_format = HostFormat.resolve(host_state, master=master, accumulate_on=accumulate_on)
    assert host_format.bytes_per_element == per_element
    buffers = allocate_host_buffers(layout, host_format)
    allocate_window_rows(layout, buffers, host_format)
    assert len(buffers) == 2
    for group, host in zip(layout, buffers):
        rows = [host.exp_avg, host.exp_avg_sq, *host.windows] + ([host.master] if master else [])
        assert all(row.is_shared() and row.shape == (group.host_numel,) for row in rows)
        assert (host.exp_avg.dtype, host.exp_avg_sq.dtype) == (moments, moments)
        assert {row.dtype for row in host.windows} == {window}
        assert len(host.windows) == (2 if accumulate_on == "host" else 1)
        assert (host.master is not None) == master
        assert host.nbytes == per_element * group.host_numel + 4 * len(group.matrices)
        assert host.step_shared.is_shared()
        assert host.step_shared.shape == (len(group.matrices),)
        assert torch.count_nonzero(host.step_shared) == 0
        for slot in group.matrices:
            if master:
                assert torch.equal(slot.view2d(host.master), slot.param.detach().float().reshape(slot.rows, slot.cols))
        # moments and window rows start at zero
        for row in (host.exp_avg, host.exp_avg_sq, *host.windows):
            assert torch.count_nonzero(row) == 0
        # one window row serves both slots in device mode; host mode alternates two
        assert (host.grad_acc(0) is host.grad_acc(1)) == (accumulate_on == "device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staging_view_round_trip(dtype):
    first = torch.nn.Parameter(torch.randn(4, 6))
    second = torch.nn.Parameter(torch.randn(3, 5))
    layout = build_layout([{"params": [first, second]}])
    host_format = HostFormat.resolve("fp32", master=True, accumulate_on="host")
    (host,) = allocate_host_buffers(layout, host_format)
    allocate_window_rows(layout, [host], host_format)
    slot_first, slot_second = layout[0].matrices
    accumulator = host.grad_acc(1)
    values = torch.randn(3, 5) * 100
    staged = staging_view(accumulator, slot_second, dtype)
    assert staged.shape == (3, 5)
    assert staged.dtype == dtype
    assert staged.data_ptr() == accumulator[slot_second.offset :].data_ptr()  # in the slot's own bytes
    staged.copy_(values)
    again = staging_view(accumulator, slot_second, dtype)
    assert torch.equal(again, values.to(dtype))
    # the other slot's region, the other accumulator and the master are untouched
    assert torch.count_nonzero(slot_first.view2d(accumulator)) == 0
    assert torch.count_nonzero(host.grad_acc(0)) == 0
    assert torch.equal(slot_second.view2d(host.master), second.detach())


@pytest.mark.parametrize(("accumulate_on", "host_state"), [("device", "bf16"), ("device", "fp32"), ("host", "bf16")])
def test_host_and_device_bytes_per_matrix_parameter_for_a_one_million_parameter_model(accumulate_on, host_state):
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 1024)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=0.1, update_interval=2, accumulate_on=accumulate_on, host_state=host_state
    )
    n_matrix = model.weight.numel()
    with ZenFlowEngine(optimizer, config, param_names={p: n for n, p in model.named_parameters()}) as engine:
        stats = []
        for _ in range(3):
            model.weight.grad = torch.randn_like(model.weight)
            model.bias.grad = torch.randn_like(model.bias)
            stats.append(engine.step())
        host_bytes = engine.host_bytes()
        device_bytes = engine.device_bytes()
    # host, per matrix element: the two moments (bf16: 2 + 2, fp32: 4 + 4) and the window rows (device mode: one,
    # bf16 or fp32; host mode: two fp32 rows); no master (the fp32 weights are the masters). Then the matrix's 1024
    # host-bound column indices for the worker (8 B each) and one fp32 step count; host mode adds its two pinned
    # staging slots, each no larger than the largest gradient (4 MiB here), and the helper's 4 MiB conversion buffer
    moments = 4 if host_state == "bf16" else 8
    windows = {"device": 2 if host_state == "bf16" else 4, "host": 8}[accumulate_on]
    staging = 2 * n_matrix * 4 + 4 * (1 << 20) if accumulate_on == "host" else 0
    assert host_bytes == (moments + windows) * n_matrix + 8 * 1024 + 4 + staging
    assert all(s.host_bytes == host_bytes for s in stats)
    # device: rho x 16 B per matrix element (fp32 master, two moments and a reused gradient buffer of the k
    # selected columns), the column indices, the bias's two moments; then per mode: the window's accumulator (bf16 or
    # fp32; no upload buffer: the landing streams from the host, through no device buffer on a CPU), or the two
    # staging slots (host)
    k = num_selected_columns(1024, 0.1)
    assert k == 103
    selected_state = 16 * 1024 * k + 8 * 1024
    bias_state = 2 * 4 * 1024  # its two moments; the fp32 bias is its own master
    # the compact accumulator's rounding draws from 4 B per row and per column of the matrix
    tables = 4 * (1024 + 1024) if (accumulate_on, host_state) == ("device", "bf16") else 0
    mode_bytes = windows * n_matrix + tables if accumulate_on == "device" else 2 * 4 * n_matrix
    # the interim moves' statistics (on by default): fp32 row and column EMAs and their scales, the host mask, the
    # warm-up's column record and three scalars of the matrix, one shared scalar
    interim = 4 * (2 * 1024 + 5 * 1024 + 3) + 4
    assert device_bytes == selected_state + bias_state + mode_bytes + interim
    assert all(s.device_bytes == device_bytes for s in stats)


def test_device_bytes_count_an_fp32_bias_as_its_own_master():
    layer = torch.nn.Linear(4, 2)  # weight [2, 4], bias [2], both fp32
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    # topk_ratio=1: every column on the device, no host worker is started, no accumulator is needed
    with ZenFlowEngine(optimizer, ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=1.0)) as engine:
        assert engine.worker_pid is None
        layer.weight.grad = torch.ones_like(layer.weight)
        layer.bias.grad = torch.ones_like(layer.bias)
        engine.step()
        device_bytes = engine.device_bytes()
    work_buffers = 4 * 8  # the reused fp32 buffer the selected gradient is gathered into
    weight_state = 3 * 4 * 8  # fp32 master, exp_avg, exp_avg_sq of the 8 weight elements
    indices = 8 * 4  # int64 selected column indices (4), no unselected ones
    bias_state = 2 * 4 * 2  # exp_avg and exp_avg_sq of the 2 bias elements; the fp32 bias is its own master
    assert device_bytes == weight_state + indices + bias_state + work_buffers


# -------------------------------------------------------------------------------------------------- selection
GRAD = torch.tensor([[1.0, -2.0, 0.0, 0.5], [3.0, 1.0, -1.0, -0.5]])


def test_column_scores_l2_and_l1_by_hand():
    assert torch.equal(column_scores(GRAD, "l2"), torch.tensor([10.0, 5.0, 1.0, 0.5]))
    assert torch.equal(column_scores(GRAD, "l1"), torch.tensor([4.0, 3.0, 1.0, 1.0]))
    bf16_scores = column_scores(GRAD.to(torch.bfloat16), "l2")
    assert bf16_scores.dtype == torch.float32
    assert torch.equal(bf16_scores, torch.tensor([10.0, 5.0, 1.0, 0.5]))
    with pytest.raises(ValueError, match="importance='l0'"):
        column_scores(GRAD, "l0")


def test_l1_and_l2_can_choose_different_columns():
    # column 0: one large entry; column 1: many medium ones
    grad = torch.tensor([[4.0, 1.5], [0.0, 1.5], [0.0, 1.5], [0.0, 1.5]])
    assert select_columns(grad, 0.5, "l2")[0].tolist() == [0]  # 16 > 9
    assert select_columns(grad, 0.5, "l1")[0].tolist() == [1]  # 6 > 4


def test_top_columns_picks_the_k_largest_ascending():
    scores = torch.tensor([0.5, 3.0, 1.0, 2.5, 2.0])
    top2 = top_columns(scores, 2)
    assert top2.tolist() == [1, 3]
    assert top2.dtype == torch.int64
    assert top_columns(scores, 3).tolist() == [1, 3, 4]
    assert top_columns(scores, 0).tolist() == []
    assert top_columns(scores, 0).dtype == torch.int64
    assert top_columns(scores, 5).tolist() == [0, 1, 2, 3, 4]
    assert top_columns(scores, 9).tolist() == [0, 1, 2, 3, 4]


def test_top_columns_ties_go_to_the_lower_index():
    assert top_columns(torch.zeros(6), 2).tolist() == [0, 1]
    assert top_columns(torch.tensor([1.0, 5.0, 5.0, 5.0, 2.0]), 2).tolist() == [1, 2]
    assert top_columns(torch.tensor([7.0, 1.0, 7.0, 1.0, 7.0, 1.0]), 4).tolist() == [0, 1, 2, 4]
    # a long tie, where an unstable sort would pick arbitrary members
    scores = torch.ones(1000)
    scores[500] = 2.0
    assert top_columns(scores, 10).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 500]


def test_select_columns_uses_k_from_the_ratio():
    grad = torch.zeros(2, 30)
    grad[:, 29] = 3.0
    grad[:, 4] = 2.0
    grad[:, 17] = 1.0
    indices, scores = select_columns(grad, 0.1, "l2")  # k = 3, not 4
    assert indices.tolist() == [4, 17, 29]
    assert scores.shape == (30,)
    assert select_columns(grad, 0.0, "l2")[0].tolist() == []
    assert select_columns(grad, 1.0, "l2")[0].tolist() == list(range(30))


def test_complement():
    assert complement(torch.tensor([1, 3]), 5).tolist() == [0, 2, 4]
    assert complement(torch.tensor([], dtype=torch.long), 3).tolist() == [0, 1, 2]
    assert complement(torch.arange(4), 4).tolist() == []
    assert complement(torch.tensor([3, 0]), 5).dtype == torch.int64


def test_diagnose_by_hand():
    previous = [torch.tensor([0, 1]), torch.tensor([2])]
    current = [torch.tensor([1, 2]), torch.tensor([2])]
    scores = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 0.0, 1.0])]
    diagnostics = diagnose(previous, current, scores)
    # matrix 0: |{1}| / |{0, 1, 2}| ; matrix 1: |{2}| / |{2}| -> pooled (1 + 1) / (3 + 1)
    assert diagnostics.overlap == pytest.approx(0.5)
    # captured: (2 + 3) + 1 of (1 + 2 + 3 + 4) + (5 + 0 + 1)
    assert diagnostics.captured_share == pytest.approx(6 / 16)
    first = diagnose(None, current, scores)
    assert first.overlap is None
    assert first.captured_share == pytest.approx(6 / 16)


def test_diagnose_degenerate_cases():
    empty = torch.tensor([], dtype=torch.long)
    diagnostics = diagnose([empty], [empty], [torch.zeros(3)])
    assert diagnostics.overlap == 1.0  # nothing selected before or after: unchanged
    assert diagnostics.captured_share == 1.0  # no score at all
    disjoint = diagnose([torch.tensor([0])], [torch.tensor([1])], [torch.tensor([1.0, 3.0])])
    assert disjoint.overlap == 0.0
    assert disjoint.captured_share == pytest.approx(0.75)


def test_engine_reports_selection_diagnostics_at_refreshes():
    """select_strategy="step": refreshes at window ends at least select_interval steps after the last selection.

    ρ = 0.2 of 10 columns gives k = 2. The gradient is 0.01 everywhere and 0.1 in two "hot" columns: {2, 7} for
    steps 1-4, then {3, 7}. Selections: t = 1 (first), t = 4 and t = 6 (window ends with t - t_sel >= 2).
    """
    torch.manual_seed(0)
    layer = torch.nn.Linear(10, 3, bias=False)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    config = ZenFlowConfig(
        full_warm_up_rounds=0, topk_ratio=0.2, update_interval=2, select_strategy="step", select_interval=2
    )

    def gradient(hot: tuple[int, int]) -> torch.Tensor:
        grad = torch.full((3, 10), 0.01)
        grad[:, list(hot)] = 0.1
        return grad

    captured = (2 * 3 * 0.1**2) / (2 * 3 * 0.1**2 + 8 * 3 * 0.01**2)
    stats = []
    with ZenFlowEngine(optimizer, config) as engine:
        for t in range(1, 9):
            layer.weight.grad = gradient((2, 7) if t <= 4 else (3, 7))
            stats.append(engine.step())
            if t == 4:
                selected_at_4 = engine.device_updater.selected[0][0].selected.tolist()
        selected_at_8 = engine.device_updater.selected[0][0].selected.tolist()
    by_step = {s.step: s for s in stats}
    assert [s.step for s in stats if s.refreshed] == [1, 4, 6, 8]
    assert by_step[1].selection_overlap is None  # the first selection has nothing to compare with
    assert by_step[1].selection_captured == pytest.approx(captured)
    assert by_step[4].selection_overlap == 1.0  # constant pattern: the same columns again
    assert by_step[4].selection_captured == pytest.approx(captured)
    assert selected_at_4 == [2, 7]
    assert by_step[6].selection_overlap == pytest.approx(1 / 3)  # {2, 7} -> {3, 7}
    assert by_step[6].selection_captured == pytest.approx(captured)
    assert by_step[8].selection_overlap == 1.0
    assert selected_at_8 == [3, 7]
    for s in stats:
        if not s.refreshed:
            assert s.selection_overlap is None
            assert s.selection_captured is None


@pytest.mark.gpu
def test_cuda_host_block_is_shared_and_pinned_in_place():
    device = torch.device("cuda")
    layer = torch.nn.Linear(16, 8).to(device)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=1e-3)
    with ZenFlowEngine(optimizer, ZenFlowConfig(full_warm_up_rounds=0, topk_ratio=0.25, update_interval=1)) as engine:
        (host,) = engine.host_buffers
        assert host.exp_avg.is_shared()
        assert host.windows[0].is_shared()
        assert host.windows[0].is_pinned()  # registered in place, not copied out of shared memory
        assert not host.exp_avg.is_pinned()  # never copied asynchronously
        assert host.master is None  # the fp32 weights are the masters
