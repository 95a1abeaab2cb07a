"""Sharded loading and the sharded export of ``lightning_zenflow.llm`` under FSDP2 (gloo, CPU ranks).

Each rank builds the model with its parameters on meta, shards it with ``fully_shard`` (blocks, then root), and reads
only its own rows of the safetensors files (``llm/sharding.py::load_sharded``, ``llm/sharded_load.py``); the export
is written one gathered tensor at a time (``llm/sharded_export.py``). The ranks run ``llm_helpers.sharded_load``,
forked by ``tests/rank_zygote.py``.

Covered: the weights bitwise those of a one-process ``from_pretrained`` in float32 and bfloat16 (2 ranks here, 4 in
the slow tier), the rotary buffers (not in the files) equal too, the embeddings one parameter; the export's tensors
bitwise those ``save_pretrained`` writes for the same weights, in the same files (several under a small size limit),
with the index, the config and the generation config, and ``from_pretrained`` loads it tied; a one-process read of the
same files (no mesh) equal too; the errors for ``pytorch_model.bin`` folders, missing tensors and wrong shapes. Each
rank's peak resident memory while it loads (``tests/test_llm_sharded_memory.py``, slow tier) is measured apart.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from llm_helpers import save_tiny_llama
from rank_zygote import Zygote

from lightning_zenflow.llm.sharded_export import parse_size, plan_files
from lightning_zenflow.llm.sharded_load import (
    ShardedLoadError,
    host_buffers,
    load_rows,
    restore_buffers,
    structure,
    weight_files,
)

transformers = pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")
pytest.importorskip("tokenizers", reason="the test tokenizer is built with `tokenizers`")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the files are compared with `safetensors`")

pytestmark = pytest.mark.usefixtures("no_leaked_children")

DTYPES = ("float32", "bfloat16")
SMALL_LIMIT = 20_000
"""An export size limit that splits the tiny model (about 100 kB in float32) into 6 files (3 in bfloat16)."""
ONE_FILE = 10**9


def launch(root: pathlib.Path, model_dir: pathlib.Path, world: int, **options: object) -> list[dict]:
    """``llm_helpers.sharded_load`` on ``world`` ranks; each rank's results."""
    request = {"entry": "llm_helpers:sharded_load", "model_dir": str(model_dir), "dtypes": list(DTYPES), **options}
    done = Zygote.run(root, request, world=world, timeout_s=240.0)
    logs = "\n".join(pathlib.Path(log).read_text()[-4000:] for log in done["logs"])
    assert done["codes"] == [0] * world, logs
    return [torch.load(root / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def assert_loaded_as_from_pretrained(ranks: list[dict], model_dir: pathlib.Path) -> None:
    """Every rank's gathered weights and buffers bitwise those of ``from_pretrained``, in each dtype, tied."""
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        expected = {name: param.detach() for name, param in reference.named_parameters()}
        for rank in ranks:
            loaded = rank["loads"][dtype_name]
            assert loaded["tied"], rank["rank"]
            assert loaded["sharded"], rank["rank"]
            assert set(loaded["dtypes"].values()) == {dtype}
            assert loaded["weights"].keys() == expected.keys()
            for name, tensor in expected.items():  # gathered as float32 copies: exact for bfloat16 too
                assert torch.equal(loaded["weights"][name], tensor.float()), f"{dtype_name} {name}"
            buffers = dict(reference.named_buffers())
            assert loaded["buffers"].keys() == buffers.keys()
            for name, buffer in buffers.items():  # not in the files: what the constructor computed
                assert buffer.dtype == loaded["buffers"][name].dtype, name
                assert torch.equal(loaded["buffers"][name], buffer), name


def tensors_of(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(path))
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("sharded_load")
    model_dir = save_tiny_llama(root / "model")
    ranks = launch(root / "ranks", model_dir, world=2, export_limits=[SMALL_LIMIT, ONE_FILE])
    return {"root": root, "model_dir": model_dir, "ranks": ranks}


def test_two_ranks_read_their_rows_bitwise_as_from_pretrained(two_ranks: dict) -> None:
    assert [rank["world"] for rank in two_ranks["ranks"]] == [2, 2]
    assert_loaded_as_from_pretrained(two_ranks["ranks"], two_ranks["model_dir"])


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("limit", [SMALL_LIMIT, ONE_FILE], ids=["several_files", "one_file"])
def test_the_sharded_export_is_what_save_pretrained_writes(
    two_ranks: dict, tmp_path: pathlib.Path, dtype_name: str, limit: int
) -> None:
    """The same weights (the loaded ones are ``from_pretrained``'s, bitwise) exported by the ranks a tensor at a
    time and by ``save_pretrained`` in one process: the same tensors, bitwise, in the same files."""
    dtype = getattr(torch, dtype_name)
    exported = two_ranks["root"] / "ranks" / f"export-{dtype_name}-{limit}"
    reference = transformers.AutoModelForCausalLM.from_pretrained(two_ranks["model_dir"], dtype=dtype)
    reference.save_pretrained(tmp_path / "single", max_shard_size=limit)
    single = tmp_path / "single"

    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in exported.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    if limit == SMALL_LIMIT:  # as many files as save_pretrained's split (it orders the tensors its own way)
        assert len(files) == len(list(single.glob("*.safetensors"))) > 1
        for name in files:  # each within the limit, but for a tensor larger than it, alone in its file
            held = safetensors_torch.load_file(exported / name)
            size = sum(tensor.numel() * tensor.element_size() for tensor in held.values())
            assert size <= limit or len(held) == 1, name
    else:  # one file, named as a shard, with its index (save_pretrained writes model.safetensors alone)
        assert files == ["model-00001-of-00001.safetensors"]
    ours, theirs = tensors_of(exported), tensors_of(single)
    assert ours.keys() == theirs.keys()
    assert "lm_head.weight" not in ours  # tied: written once, under the embeddings' name
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype == dtype, name
        assert torch.equal(ours[name], tensor), name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in theirs.values())
    for config in ("config.json", "generation_config.json"):
        assert json.loads((exported / config).read_text()) == json.loads((single / config).read_text()), config

    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.dtype == dtype
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    for name, param in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], param), name


@pytest.mark.slow
def test_four_ranks_read_their_rows_bitwise_as_from_pretrained(tmp_path: pathlib.Path) -> None:
    """4 ranks: some of the tiny model's row counts (2 key-value heads of 8: 16 rows) split unevenly into blocks."""
    model_dir = save_tiny_llama(tmp_path / "model")
    ranks = launch(tmp_path / "ranks", model_dir, world=4)
    assert [rank["rank"] for rank in ranks] == [0, 1, 2, 3]
    assert_loaded_as_from_pretrained(ranks, model_dir)


@pytest.mark.slow
def test_hsdp_ranks_read_their_shard_groups_rows_bitwise_as_from_pretrained(tmp_path: pathlib.Path) -> None:
    """4 ranks as 2 replicas of 2-rank shard groups (``(Replicate(), Shard(0))``): each replica reads the rows of its
    shard group's block, and the export (all-gathers over the 2-D mesh) is ``save_pretrained``'s."""
    model_dir = save_tiny_llama(tmp_path / "model")
    ranks = launch(tmp_path / "ranks", model_dir, world=4, replicas=2, export_limits=[SMALL_LIMIT])
    assert_loaded_as_from_pretrained(ranks, model_dir)
    for dtype_name in DTYPES:
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
        exported = tensors_of(tmp_path / "ranks" / f"export-{dtype_name}-{SMALL_LIMIT}")
        expected = {name: tensor for name, tensor in reference.state_dict().items() if name != "lm_head.weight"}
        assert exported.keys() == expected.keys()
        for name, tensor in expected.items():
            assert torch.equal(exported[name], tensor), f"{dtype_name} {name}"


# ------------------------------------------------------------------------------------------- one process


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def read_unsharded(folder: pathlib.Path, dtype: torch.dtype) -> torch.nn.Module:
    """The reader without a mesh: every tensor is whole, read into a model built by ``structure``."""
    config = transformers.AutoConfig.from_pretrained(folder)
    model = structure(config, dtype)
    saved = host_buffers(model)
    model.to_empty(device="cpu")
    model.tie_weights()  # plain parameters come apart in to_empty (FSDP2's DTensors do not)
    restore_buffers(model, saved)
    load_rows(model, folder)
    return model


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_the_reader_without_a_mesh_equals_from_pretrained(model_dir: pathlib.Path, dtype_name: str) -> None:
    dtype = getattr(torch, dtype_name)
    config = transformers.AutoConfig.from_pretrained(model_dir)
    built = structure(config, dtype)
    assert all(param.is_meta for param in built.parameters())  # no weight allocated
    assert not any(buffer.is_meta for buffer in built.buffers())  # the rotary tables computed
    model = read_unsharded(model_dir, dtype)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    for name, buffer in reference.named_buffers():
        assert torch.equal(model.get_buffer(name), buffer), name


def test_a_pytorch_model_bin_folder_is_refused_with_the_fix(tmp_path: pathlib.Path, model_dir: pathlib.Path) -> None:
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text((model_dir / "config.json").read_text())
    torch.save(safetensors_torch.load_file(model_dir / "model.safetensors"), folder / "pytorch_model.bin")
    fix = r"pytorch_model.bin weights.*save_pretrained\(new_folder\).*load_weights now"
    with pytest.raises(ShardedLoadError, match=fix):
        weight_files(folder)
    with pytest.raises(ShardedLoadError, match=r"no model.safetensors or model.safetensors.index.json in"):
        weight_files(tmp_path)


def test_missing_tensors_and_other_shapes_are_refused_extra_ones_warned_of(
    tmp_path: pathlib.Path, model_dir: pathlib.Path
) -> None:
    weights = safetensors_torch.load_file(model_dir / "model.safetensors")
    for name in ("missing", "reshaped"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text((model_dir / "config.json").read_text())
    norm = "model.norm.weight"
    without_norm = {key: value for key, value in weights.items() if key != norm}
    safetensors_torch.save_file(without_norm, tmp_path / "missing" / "model.safetensors")
    with pytest.raises(ShardedLoadError, match=r"hold no model.norm.weight: .*load_weights now"):
        read_unsharded(tmp_path / "missing", torch.float32)
    (tmp_path / "extra").mkdir()
    (tmp_path / "extra" / "config.json").write_text((model_dir / "config.json").read_text())
    extra = {**weights, "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}  # an old file's leftover
    safetensors_torch.save_file(extra, tmp_path / "extra" / "model.safetensors")
    with pytest.warns(UserWarning, match=r"also hold model.layers.0.self_attn.rotary_emb.inv_freq, unused"):
        read_unsharded(tmp_path / "extra", torch.float32)
    safetensors_torch.save_file({**weights, norm: weights[norm][:-2]}, tmp_path / "reshaped" / "model.safetensors")
    shapes = r"model.norm.weight has shape \(30,\), the model's model.norm.weight \(32,\)"
    with pytest.raises(ShardedLoadError, match=shapes):
        read_unsharded(tmp_path / "reshaped", torch.float32)


def test_export_sizes_and_the_split_into_files() -> None:
    assert parse_size(123) == 123
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500 MB") == 500 * 10**6
    with pytest.raises(ValueError, match=r"export_max_shard_size 'big' is not a size.*--model.export_max_shard_size"):
        parse_size("big")
    with pytest.raises(ValueError, match=r"must be positive, got 0"):
        parse_size(0)
    four = ((1,), torch.float32)
    files = plan_files([("a", *four), ("b", (3,), torch.float32), ("c", *four), ("d", (10,), torch.float32)], 16)
    # a new file when the next tensor would pass 16 bytes; a tensor larger than the limit gets a file of its own
    assert [[name for name, _, _ in planned.tensors] for planned in files] == [["a", "b"], ["c"], ["d"]]
    assert [planned.name for planned in files] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
