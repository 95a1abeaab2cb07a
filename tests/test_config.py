"""Tests of ZenFlowConfig: defaults, validation messages (they name the option and the fix), core split, k."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest

from lightning_zenflow.config import SYNC_BOUNDARIES, ZenFlowConfig, num_selected_columns

pytestmark = pytest.mark.usefixtures("no_leaked_children")


def test_defaults():
    config = ZenFlowConfig()
    assert config.topk_ratio == 0.1
    assert config.update_interval == 4
    assert config.select_strategy == "auto"
    assert config.select_interval == "auto"
    assert config.full_warm_up_rounds == 10
    assert config.overlap_step is True
    assert config.importance == "l2"
    assert config.sync_on == ()
    assert config.host_threads is None
    assert config.pt_reserved_cores_perc == 0.5
    assert config.bind_cores is True
    assert config.worker_timeout_s == 10.0
    assert set(config.sync_on) <= set(SYNC_BOUNDARIES)


def test_config_is_frozen_and_replace_validates_again():
    config = ZenFlowConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.topk_ratio = 0.5  # type: ignore[misc]
    assert config.replace(topk_ratio=0.25).topk_ratio == 0.25
    assert config.topk_ratio == 0.1
    with pytest.raises(ValueError, match="topk_ratio"):
        config.replace(topk_ratio=2.0)


@pytest.mark.parametrize("ratio", [0, 0.0, 0.5, 1, 1.0])
def test_topk_ratio_accepts_the_closed_unit_interval(ratio):
    assert ZenFlowConfig(topk_ratio=ratio).topk_ratio == ratio


@pytest.mark.parametrize("ratio", [-0.1, 1.5, float("nan"), float("inf")])
def test_topk_ratio_out_of_range(ratio):
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(topk_ratio=ratio)
    message = str(error.value)
    assert "topk_ratio" in message
    assert "[0, 1]" in message
    assert "topk_ratio=0.1" in message  # the fix: a value that works


@pytest.mark.parametrize("ratio", [True, False, "0.1", None])
def test_topk_ratio_wrong_type(ratio):
    with pytest.raises(TypeError) as error:
        ZenFlowConfig(topk_ratio=ratio)
    assert "topk_ratio must be a number in [0, 1]" in str(error.value)


@pytest.mark.parametrize("interval", [0, -1])
def test_update_interval_too_small(interval):
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(update_interval=interval)
    message = str(error.value)
    assert f"update_interval={interval}" in message
    assert ">= 1" in message
    assert "'auto'" in message


@pytest.mark.parametrize("interval", ["fast", 2.5, True, None])
def test_update_interval_wrong_type(interval):
    with pytest.raises(TypeError) as error:
        ZenFlowConfig(update_interval=interval)
    message = str(error.value)
    assert "update_interval must be an int >= 1 or 'auto'" in message
    assert repr(interval) in message


def test_update_interval_auto_is_accepted():
    assert ZenFlowConfig(update_interval="auto").update_interval == "auto"


def test_select_strategy_unknown():
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(select_strategy="batch")
    message = str(error.value)
    assert "select_strategy='batch'" in message
    assert "'auto', 'step', 'epoch'" in message
    assert "select_interval=<steps>" in message


def test_auto_strategy_with_an_integer_interval():
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(select_strategy="auto", select_interval=3)
    message = str(error.value)
    assert "select_strategy='auto' takes select_interval='auto'" in message
    assert "select_strategy='step'" in message  # the fix


@pytest.mark.parametrize("strategy", ["step", "epoch"])
def test_step_and_epoch_need_an_integer_interval(strategy):
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(select_strategy=strategy, select_interval="auto")
    message = str(error.value)
    assert f"select_strategy={strategy!r} needs an integer select_interval" in message
    assert "select_interval=1" in message


def test_select_interval_shorter_than_update_interval_for_step():
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(select_strategy="step", select_interval=2, update_interval=4)
    message = str(error.value)
    assert "select_interval=2 is shorter than update_interval=4" in message
    assert "select_interval >= update_interval" in message
    # equal is fine, and "epoch" counts epochs, not steps, so it is not compared with the window
    assert ZenFlowConfig(select_strategy="step", select_interval=4, update_interval=4).select_interval == 4
    assert ZenFlowConfig(select_strategy="epoch", select_interval=1, update_interval=8).select_interval == 1


@pytest.mark.parametrize("interval", [0, -2])
def test_select_interval_too_small(interval):
    with pytest.raises(ValueError, match=rf"select_interval={interval} must be >= 1"):
        ZenFlowConfig(select_strategy="step", select_interval=interval, update_interval=1)


def test_full_warm_up_rounds_negative():
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(full_warm_up_rounds=-1)
    message = str(error.value)
    assert "full_warm_up_rounds=-1 must be >= 0" in message
    assert "0 turns warm-up off" in message


@pytest.mark.parametrize("rounds", [1.5, "2", True, None])
def test_full_warm_up_rounds_not_an_int(rounds):
    with pytest.raises(TypeError) as error:
        ZenFlowConfig(full_warm_up_rounds=rounds)
    assert "full_warm_up_rounds must be an int >= 0" in str(error.value)


def test_overlap_after():
    assert ZenFlowConfig().overlap_after == 0
    assert ZenFlowConfig(overlap_after=16).overlap_after == 16
    with pytest.raises(ValueError, match="overlap_after=-1 must be >= 0"):
        ZenFlowConfig(overlap_after=-1)
    for value in (1.5, "16", True, None):
        with pytest.raises(TypeError, match="overlap_after must be an int >= 0"):
            ZenFlowConfig(overlap_after=value)


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_overlap_step_must_be_bool(value):
    with pytest.raises(TypeError) as error:
        ZenFlowConfig(overlap_step=value)
    assert "overlap_step must be True or False" in str(error.value)


def test_importance_unknown():
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(importance="l3")
    message = str(error.value)
    assert "importance='l3'" in message
    assert "'l2'" in message
    assert "'l1'" in message


def test_sync_on_unknown_entry():
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(sync_on=("validation", "train_batch_end"))
    message = str(error.value)
    assert "sync_on has unknown boundaries ['train_batch_end']" in message
    for boundary in SYNC_BOUNDARIES:
        assert boundary in message  # the choices


def test_sync_on_single_string_and_list_are_normalised_to_a_tuple():
    assert ZenFlowConfig(sync_on="epoch_end").sync_on == ("epoch_end",)
    assert ZenFlowConfig(sync_on=["checkpoint", "validation"]).sync_on == ("checkpoint", "validation")
    assert ZenFlowConfig(sync_on=()).sync_on == ()
    with pytest.raises(ValueError, match=r"unknown boundaries \['epoch'\]"):
        ZenFlowConfig(sync_on="epoch")  # a single wrong string is not split into characters


@pytest.mark.parametrize("threads", [0, -1, True, 2.0])
def test_host_threads_invalid(threads):
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(host_threads=threads)
    message = str(error.value)
    assert f"host_threads={threads!r}" in message
    assert "positive int or None" in message


def test_host_threads_valid():
    assert ZenFlowConfig(host_threads=3).host_threads == 3


@pytest.mark.parametrize("share", [1.5, -0.1, float("nan")])
def test_pt_reserved_cores_perc_out_of_range(share):
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(pt_reserved_cores_perc=share)
    message = str(error.value)
    assert "pt_reserved_cores_perc" in message
    assert "outside [0, 1]" in message
    assert "0.5 gives the training process half of the cores" in message


@pytest.mark.parametrize("timeout", [0, -1.0, float("nan")])
def test_worker_timeout_must_be_positive(timeout):
    with pytest.raises(ValueError) as error:
        ZenFlowConfig(worker_timeout_s=timeout)
    assert "worker_timeout_s" in str(error.value)
    assert "must be > 0 seconds" in str(error.value)


def test_bind_cores_must_be_bool():
    with pytest.raises(TypeError, match="bind_cores must be True or False"):
        ZenFlowConfig(bind_cores=1)


@pytest.mark.parametrize(("option", "value"), [("worker_timeout_s", "5"), ("pt_reserved_cores_perc", "0.5")])
def test_numeric_options_reject_strings(option, value):
    with pytest.raises((TypeError, ValueError), match=option):
        ZenFlowConfig(**{option: value})


# ------------------------------------------------------------------------------------------------- core_split
def test_core_split_one_core_is_shared():
    train, host = ZenFlowConfig().core_split([3])
    assert train == [3]
    assert host == [3]


def test_core_split_two_cores():
    train, host = ZenFlowConfig().core_split([1, 0])
    assert train == [0]
    assert host == [1]


@pytest.mark.parametrize(
    ("share", "expected_train"),
    [(0.5, 4), (0.0, 1), (0.1, 1), (0.75, 6), (1.0, 7)],
)
def test_core_split_eight_cores(share, expected_train):
    cores = [7, 6, 5, 4, 3, 2, 1, 0]
    train, host = ZenFlowConfig(pt_reserved_cores_perc=share).core_split(cores)
    assert len(train) == expected_train
    assert len(host) >= 1  # the worker always gets a core, even with pt_reserved_cores_perc=1
    assert len(train) >= 1
    assert set(train).isdisjoint(host)
    assert sorted(train + host) == sorted(cores)
    assert train == sorted(train)
    assert host == sorted(host)


def test_core_split_defaults_to_this_process_affinity():
    train, host = ZenFlowConfig().core_split()
    available = sorted(os.sched_getaffinity(0))
    assert sorted(set(train) | set(host)) == available
    if len(available) >= 2:
        assert set(train).isdisjoint(host)
    assert host


# ------------------------------------------------------------------------------------------ num_selected_columns
def test_num_selected_columns_edges():
    assert num_selected_columns(30, 0.0) == 0
    assert num_selected_columns(30, 0) == 0
    assert num_selected_columns(30, 1.0) == 30
    assert num_selected_columns(30, 1) == 30


def test_num_selected_columns_ignores_float_noise():
    assert num_selected_columns(30, 0.1) == 3
    # the noise this guards against: these products land just above the integer
    assert 0.07 * 100 > 7
    assert num_selected_columns(100, 0.07) == 7
    assert 0.14 * 50 > 7
    assert num_selected_columns(50, 0.14) == 7


def test_num_selected_columns_rounds_up():
    assert num_selected_columns(10, 0.25) == 3  # ceil(2.5)
    assert num_selected_columns(7, 0.5) == 4
    assert num_selected_columns(1000, 0.1001) == 101


@pytest.mark.parametrize("ratio", [1e-6, 1e-12, 0.001])
def test_num_selected_columns_tiny_ratio_keeps_one(ratio):
    assert num_selected_columns(100, ratio) == 1


def test_num_selected_columns_never_exceeds_the_columns():
    for columns in range(1, 40):
        for ratio in (0.01, 0.1, 0.33, 0.5, 0.99):
            k = num_selected_columns(columns, ratio)
            assert 1 <= k <= columns
            assert k == min(columns, max(1, math.ceil(ratio * columns - 1e-9)))
