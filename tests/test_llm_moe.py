"""Mixture-of-experts Hugging Face folders in ``lightning_zenflow.llm``: loading, export, checkpoints and the recipe's
fit, under ``zenflow`` (one process), ``zenflow_ddp`` and ``zenflow_fsdp`` (2 ranks, gloo, forked by
``tests/rank_zygote.py``).

The models are tiny and random (``llm_helpers.save_random_moe``: 8 experts, 2 a token, 2 layers, hidden 32), saved by
``transformers``' own ``save_pretrained``: Qwen3-MoE and Mixtral write one tensor per expert, which ``transformers``
fuses into ``[experts, out, in]`` parameters at load time (Mixtral's names renamed first), GPT-OSS writes its fused
``[experts, in, out]`` parameters as they are.

Covered, default tier: at 2 ranks of FSDP2 each rank reads only its own rows and its own experts' tensors (the bytes
each rank read equal those of its rows and experts, counted from the files' headers), and the weights gathered are
bitwise ``from_pretrained``'s, float32 and bfloat16, for the three architectures; the sharded export (a group of
tensors at a time) writes the tensors ``save_pretrained`` writes for the same weights (per-expert names, shapes,
dtypes, bitwise values), with an index naming the file of each, in one file and in several; the reader and
``save_pretrained``'s export in one process; the refusals, from the headers before anything is allocated, of a rule
that cannot be read per row (naming it and the fix, which loads), of a missing expert, of an expert of another shape
and of a quantized folder, and the CLI's one ``error:`` line for a refusal. The recipe's fit of a Qwen3-MoE folder on
2 ranks of ``zenflow_ddp`` and ``zenflow_fsdp`` equals one process on the global batches, and its export reloads as
the final weights. Slow tier: 4 ranks (2 experts a rank); each of 4 ranks' resident peak while it reads a 222 MB
Qwen3-MoE (its share and one tensor); ``zenflow_fsdp`` reading its experts per rank trains bitwise as reading the
whole model (``load_weights="now"``); a sharded checkpoint resumes exactly at 2 ranks and at 1 (resharded), with
``export_on_checkpoint``'s folder the checkpoint's weights.

The engine's view of a 3-D parameter is its own business: every fit here is compared with another fit of the same
code (one process, or the same fit not stopped), never with a number that depends on that view.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from lightning_helpers import assert_weights_equal
from llm_helpers import TINY_MOE, fit, mean_loss, save_random_moe, save_random_qwen3_moe, write_text
from rank_zygote import Zygote
from test_llm_distributed import (
    BLOCK_SIZE,
    CHECKPOINT_EVERY,
    KNOBS,
    LR,
    PER_RANK_BATCH,
    PROMPT,
    RESUME_KNOBS,
    RESUME_STEPS,
    STEPS,
    TRAIN_BLOCKS,
    VAL_BLOCKS,
    VAL_FRACTION,
    assert_close_up_to_adam_rounding,
)

from lightning_zenflow.llm import CausalLMDataModule
from lightning_zenflow.llm.data import load_tokenizer
from lightning_zenflow.llm.module import export, generate_sample
from lightning_zenflow.llm.sharded_load import (
    ShardedLoadError,
    host_buffers,
    load_rows,
    plan_folder,
    read_header,
    restore_buffers,
    structure,
    weight_files,
)

transformers = pytest.importorskip("transformers", reason="lightning_zenflow.llm needs `pip install '.[llm]'`")
pytest.importorskip("tokenizers", reason="the test tokenizer is built with `tokenizers`")
safetensors_torch = pytest.importorskip("safetensors.torch", reason="the files are compared with `safetensors`")
conversion_mapping = pytest.importorskip(
    "transformers.conversion_mapping", reason="transformers 4 builds experts as modules: no conversions to test"
)

pytestmark = pytest.mark.usefixtures("no_leaked_children")

ARCHITECTURES = tuple(TINY_MOE)
EXPERTS = 8
"""The tiny models' experts a layer (``llm_helpers.TINY_MOE``)."""
DTYPES = ("float32", "bfloat16")
SMALL_LIMIT = 20_000
"""An export size limit that splits each tiny model (about 170 kB in float32) into several files."""
ONE_FILE = 10**9


def launch(root: pathlib.Path, request: dict, world: int) -> list[dict]:
    """``request`` (``llm_helpers.sharded_load``'s options) on ``world`` forked ranks; each rank's results (written
    into ``root/launch``, with the exports)."""
    done = Zygote.run(root / "launch", request, world=world, timeout_s=240.0)
    logs = "\n".join(pathlib.Path(log).read_text()[-4000:] for log in done["logs"])
    assert done["codes"] == [0] * world, logs
    return [torch.load(root / "launch" / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def launch_fits(root: pathlib.Path, fits: dict[str, dict], world: int) -> dict[str, list[dict]]:
    """The ``llm_helpers.fit`` ``fits`` in one launch of ``world`` ranks, one after another; each one's results."""
    batch = [[str(root / name), options] for name, options in fits.items()]
    done = Zygote.run(root / f"launch-{world}", {"batch": batch}, world=world, timeout_s=300.0)
    logs = "\n".join(pathlib.Path(log).read_text()[-4000:] for log in done["logs"])
    assert done["codes"] == [0] * world, logs
    return {name: [torch.load(root / name / f"rank{r}.pt", weights_only=False) for r in range(world)] for name in fits}


def tensors_of(folder: pathlib.Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(path))
    return out


def expected_read_bytes(model_dir: pathlib.Path, world: int) -> list[int]:
    """The bytes each of ``world`` ranks owns in ``model_dir``'s files, from their headers: of a per-expert tensor
    all of it on the rank whose block of experts holds it (``torch.chunk`` blocks), of any other tensor the bytes of
    the rank's rows (a fused expert tensor's rows are experts too)."""
    config = json.loads((model_dir / "config.json").read_text())
    experts = config.get("num_experts") or config["num_local_experts"]
    owned = [0] * world
    for path in weight_files(model_dir):
        header, _ = read_header(path)
        for key, entry in header.items():
            nbytes = entry["data_offsets"][1] - entry["data_offsets"][0]
            expert = re.search(r"\.experts\.(\d+)\.", key)
            if expert is not None:
                owned[int(expert.group(1)) // math.ceil(experts / world)] += nbytes
                continue
            rows = entry["shape"][0] if entry["shape"] else 1
            block = math.ceil(rows / world)
            for rank in range(world):
                owned[rank] += max(0, min(rows, (rank + 1) * block) - rank * block) * (nbytes // rows)
    return owned


def assert_loaded_as_from_pretrained(ranks: list[dict], model_dir: pathlib.Path) -> None:
    """Every rank's gathered weights and buffers bitwise those of ``from_pretrained``, in each dtype, tied."""
    for dtype_name in DTYPES:
        dtype = getattr(torch, dtype_name)
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        expected = {name: param.detach() for name, param in reference.named_parameters()}
        assert any(tensor.dim() == 3 for tensor in expected.values())  # the fused experts
        for rank in ranks:
            loaded = rank["loads"][dtype_name]
            assert loaded["tied"], rank["rank"]
            assert loaded["sharded"], rank["rank"]
            assert set(loaded["dtypes"].values()) == {dtype}
            assert loaded["weights"].keys() == expected.keys()
            for name, tensor in expected.items():  # gathered as float32 copies: exact for bfloat16 too
                assert torch.equal(loaded["weights"][name], tensor.float()), f"{dtype_name} {name}"
            buffers = dict(reference.named_buffers())
            for name, buffer in buffers.items():
                assert torch.equal(loaded["buffers"][name], buffer), name


# ------------------------------------------------------------------------------- loading and export, 2 ranks


@pytest.fixture(scope="module", params=ARCHITECTURES)
def two_ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp(f"moe_{request.param}")
    model_dir = save_random_moe(root / "model", request.param)
    options = {"entry": "llm_helpers:sharded_load", "model_dir": str(model_dir), "dtypes": list(DTYPES)}
    ranks = launch(root, {**options, "export_limits": [SMALL_LIMIT, ONE_FILE]}, world=2)
    return {"root": root, "model_dir": model_dir, "ranks": ranks, "architecture": request.param}


def test_two_ranks_read_their_experts_bitwise_as_from_pretrained(two_ranks: dict) -> None:
    assert [rank["world"] for rank in two_ranks["ranks"]] == [2, 2]
    assert_loaded_as_from_pretrained(two_ranks["ranks"], two_ranks["model_dir"])


def test_each_rank_reads_the_bytes_of_its_own_rows_and_experts_only(two_ranks: dict) -> None:
    """Of a per-expert tensor the rank that holds the expert reads all, the other nothing; of any other tensor each
    rank its rows: every byte of the files is read once, by one rank, in both dtypes (bfloat16 converts the same
    bytes)."""
    expected = expected_read_bytes(two_ranks["model_dir"], world=2)
    for dtype_name in DTYPES:
        assert [rank["loads"][dtype_name]["read_bytes"] for rank in two_ranks["ranks"]] == expected, dtype_name
    data_bytes = sum(
        entry["data_offsets"][1] - entry["data_offsets"][0]
        for path in weight_files(two_ranks["model_dir"])
        for entry in read_header(path)[0].values()
    )
    assert sum(expected) == data_bytes
    assert abs(expected[0] - expected[1]) < data_bytes // 20  # about half each


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("limit", [SMALL_LIMIT, ONE_FILE], ids=["several_files", "one_file"])
def test_the_sharded_export_writes_what_save_pretrained_writes(
    two_ranks: dict, tmp_path: pathlib.Path, dtype_name: str, limit: int
) -> None:
    """The loaded weights (``from_pretrained``'s, bitwise) exported by the ranks a group at a time and by
    ``save_pretrained`` in one process: the same tensors (per expert where the files were), bitwise, and the same
    configs. The split into files may differ under a small limit (``save_pretrained`` keeps a fused tensor's experts
    together), each tensor where the index says."""
    dtype = getattr(torch, dtype_name)
    exported = two_ranks["root"] / "launch" / f"export-{dtype_name}-{limit}"
    reference = transformers.AutoModelForCausalLM.from_pretrained(two_ranks["model_dir"], dtype=dtype)
    reference.save_pretrained(tmp_path / "single", max_shard_size=limit)
    ours, theirs = tensors_of(exported), tensors_of(tmp_path / "single")
    assert ours.keys() == theirs.keys()
    assert ours.keys() == tensors_of(two_ranks["model_dir"]).keys()  # the names the files had
    fused = any(name.endswith("experts.gate_up_proj") for name in ours)
    assert fused is (two_ranks["architecture"] == "gpt_oss")  # else per expert, as the files were
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype == dtype, name
        assert torch.equal(ours[name], tensor), name
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    files = sorted(path.name for path in exported.glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == files
    assert (len(files) > 1) is (limit == SMALL_LIMIT)
    for name in files:  # each tensor in the file the index names, each file within the limit (or one tensor alone)
        held = safetensors_torch.load_file(exported / name)
        assert {key for key, file in index["weight_map"].items() if file == name} == held.keys()
        assert sum(t.numel() * t.element_size() for t in held.values()) <= limit or len(held) == 1, name
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in theirs.values())
    for config in ("config.json", "generation_config.json"):
        assert json.loads((exported / config).read_text()) == json.loads((tmp_path / "single" / config).read_text())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    for name, tensor in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name


@pytest.mark.slow
def test_four_ranks_read_two_experts_each_bitwise_as_from_pretrained(tmp_path: pathlib.Path) -> None:
    model_dir = save_random_qwen3_moe(tmp_path / "model")
    options = {"entry": "llm_helpers:sharded_load", "model_dir": str(model_dir), "dtypes": list(DTYPES)}
    ranks = launch(tmp_path, {**options, "export_limits": [SMALL_LIMIT]}, world=4)
    assert_loaded_as_from_pretrained(ranks, model_dir)
    for dtype_name in DTYPES:
        expected = expected_read_bytes(model_dir, world=4)
        assert [rank["loads"][dtype_name]["read_bytes"] for rank in ranks] == expected
        reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
        reference.save_pretrained(tmp_path / f"single-{dtype_name}")
        theirs = tensors_of(tmp_path / f"single-{dtype_name}")
        ours = tensors_of(tmp_path / "launch" / f"export-{dtype_name}-{SMALL_LIMIT}")
        assert ours.keys() == theirs.keys()
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), f"{dtype_name} {name}"


LOADING_QWEN3_MOE = {
    "vocab_size": 16384,
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "num_experts": 32,
    "moe_intermediate_size": 512,
}
"""A Qwen3-MoE of 55.6 M parameters (222 MB in float32), 91 % of them in 4 x 32 experts: each rank's share (8 experts of
each layer) stands well above the noise of a process's resident memory."""


@pytest.mark.slow
@pytest.mark.parametrize("dtype_name", DTYPES)  # bfloat16: every tensor goes through the 4 MiB staging buffer
def test_each_rank_peaks_at_its_experts_share_plus_one_tensor(tmp_path: pathlib.Path, dtype_name: str) -> None:
    """4 fresh ranks read a Qwen3-MoE of several files: each reads the bytes of its share alone (its 8 experts of
    every layer, its rows of the rest), and its resident peak (``VmHWM``, as ``tests/test_llm_sharded_memory.py``
    measures it) rises above the model built and sharded on meta by that share and at most one tensor of the model
    more (a fused expert parameter, the largest), where reading the whole model would rise four times the share."""
    model_dir = save_random_qwen3_moe(tmp_path / "random_qwen3_moe", "60MB", **LOADING_QWEN3_MOE)
    assert len(weight_files(model_dir)) > 1
    options = {"entry": "llm_helpers:sharded_load", "model_dir": str(model_dir), "dtypes": [dtype_name]}
    ranks = launch(tmp_path, {**options, "gather": False}, world=4)
    owned = expected_read_bytes(model_dir, world=4)
    assert [rank["loads"][dtype_name]["read_bytes"] for rank in ranks] == owned
    scale = getattr(torch, dtype_name).itemsize / torch.float32.itemsize  # the files are float32
    config = LOADING_QWEN3_MOE
    fused = config["num_experts"] * 2 * config["moe_intermediate_size"] * config["hidden_size"] * 4 * scale
    print(
        f"\nQwen3-MoE {dtype_name}: a rank's share {max(owned) * scale / 1e6:.1f} MB, "
        f"one fused tensor {fused / 1e6:.1f} MB"
    )
    for rank, owned_bytes in zip(ranks, owned):
        loaded = rank["loads"][dtype_name]
        above = (loaded["loaded_kib"] - loaded["meta_kib"]) * 1024
        print(f"  rank {rank['rank']}: read {owned_bytes / 1e6:.1f} MB, resident peak {above / 1e6:.1f} MB above meta")
        assert 0.9 * owned_bytes * scale <= above <= owned_bytes * scale + fused, rank["rank"]


# ------------------------------------------------------------------------------------------------ one process


def read_unsharded(folder: pathlib.Path, dtype: torch.dtype) -> torch.nn.Module:
    """The reader without a mesh: every tensor whole, read into a model built by ``structure``."""
    model = structure(transformers.AutoConfig.from_pretrained(folder), dtype)
    saved = host_buffers(model)
    plan = plan_folder(model, folder)  # on meta: the refusals come here
    model.to_empty(device="cpu")
    model.tie_weights()  # plain parameters come apart in to_empty (FSDP2's DTensors do not)
    restore_buffers(model, saved)
    load_rows(model, folder, plan)
    return model


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return save_random_qwen3_moe(tmp_path_factory.mktemp("qwen3_moe") / "model")


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_the_reader_and_the_whole_export_in_one_process(tmp_path: pathlib.Path, architecture: str) -> None:
    """The reader without a mesh gives ``from_pretrained``'s weights, and ``export`` (``save_pretrained`` of the
    model, or of a checkpoint's state dict) writes the files' own tensors, as ``save_pretrained`` after
    ``from_pretrained`` does."""
    model_dir = save_random_moe(tmp_path / "model", architecture)
    model = read_unsharded(model_dir, torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name
    tokenizer = load_tokenizer(str(model_dir))
    export(model, tokenizer, str(tmp_path / "whole"))
    export(model, tokenizer, str(tmp_path / "from_state"), state_dict=dict(model.state_dict()))
    theirs = tensors_of(model_dir)
    for folder in ("whole", "from_state"):
        ours = tensors_of(tmp_path / folder)
        assert ours.keys() == theirs.keys(), folder
        for name, tensor in theirs.items():
            assert torch.equal(ours[name], tensor), f"{folder} {name}"


def qkv_fused(source: pathlib.Path, target: pathlib.Path) -> pathlib.Path:
    """A copy of ``source`` whose files hold each layer's query, key and value projections as one ``qkv_proj``
    tensor (as Phi-3's do)."""
    target.mkdir()
    for path in source.iterdir():
        if path.suffix != ".safetensors":
            (target / path.name).write_bytes(path.read_bytes())
    weights = safetensors_torch.load_file(source / "model.safetensors")
    for layer in range(2):
        parts = [weights.pop(f"model.layers.{layer}.self_attn.{p}_proj.weight") for p in "qkv"]
        weights[f"model.layers.{layer}.self_attn.qkv_proj.weight"] = torch.cat(parts)
    safetensors_torch.save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    return target


def test_a_rule_that_cannot_be_read_per_row_is_refused_naming_it_and_the_fix(
    tmp_path: pathlib.Path, qwen3_moe_dir: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rule the reader does not know (here a fused ``qkv_proj`` split into the three projections) is refused from
    the headers, before anything is allocated, with the rule and the fixes; ``from_pretrained`` (the fix
    ``load_weights now``) reads the folder."""
    from transformers.core_model_loading import Split, WeightConverter

    conversion_mapping.get_checkpoint_conversion_mapping("qwen3_moe")  # builds transformers' cache of rules
    rules = conversion_mapping._checkpoint_conversion_mapping_cache
    split = WeightConverter(
        source_patterns="self_attn.qkv_proj.weight",
        target_patterns=["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
        operations=[Split(dim=0)],
    )
    monkeypatch.setitem(rules, "Qwen3MoeForCausalLM", [*rules["qwen3_moe"], split])
    folder = qkv_fused(qwen3_moe_dir, tmp_path / "qkv")
    model = structure(transformers.AutoConfig.from_pretrained(folder), torch.float32)
    refusal = (
        r"file tensor model\.layers\.0\.self_attn\.qkv_proj\.weight .* becomes model\.layers\.0\.self_attn\.q_proj"
        r"\.weight by transformers' rule WeightConverter\(.*qkv_proj.*operations \[Split\(dim=0\)\].*"
        r"save_original_format=False.*--model\.load_weights now.*zenflow_ddp"
    )
    with pytest.raises(ShardedLoadError, match=refusal):
        plan_folder(model, folder)
    assert all(param.is_meta for param in model.parameters())  # nothing allocated
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    for name, tensor in transformers.AutoModelForCausalLM.from_pretrained(qwen3_moe_dir).state_dict().items():
        assert torch.equal(loaded[name], tensor), name


def test_a_missing_expert_and_a_quantized_folder_are_refused_with_the_fix(
    tmp_path: pathlib.Path, qwen3_moe_dir: pathlib.Path
) -> None:
    weights = safetensors_torch.load_file(qwen3_moe_dir / "model.safetensors")
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing" / "config.json").write_text((qwen3_moe_dir / "config.json").read_text())
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    without = {key: value for key, value in weights.items() if key != gone}
    safetensors_torch.save_file(without, tmp_path / "missing" / "model.safetensors", metadata={"format": "pt"})
    model = structure(transformers.AutoConfig.from_pretrained(qwen3_moe_dir), torch.float32)
    missing = (
        r"the files hold 7 tensors of the pattern mlp\.experts\.\*\.up_proj\.weight .* where "
        r"model\.layers\.1\.mlp\.experts\.gate_up_proj \(8, 32, 32\) stacks 8: .*load_weights now"
    )
    with pytest.raises(ShardedLoadError, match=missing):
        plan_folder(model, tmp_path / "missing")
    reshaped = {**weights, gone: weights[gone][:-2]}
    (tmp_path / "reshaped").mkdir()
    safetensors_torch.save_file(reshaped, tmp_path / "reshaped" / "model.safetensors", metadata={"format": "pt"})
    shape = rf"{re.escape(gone)} has shape \(14, 32\), the model's model\.layers\.1\.mlp\.experts\.gate_up_proj\[3\]"
    with pytest.raises(ShardedLoadError, match=shape):
        plan_folder(model, tmp_path / "reshaped")
    model.config.quantization_config = {"quant_method": "mxfp4"}  # as a pre-quantized GPT-OSS folder's config.json
    with pytest.raises(ShardedLoadError, match=r"quantization_config \(mxfp4\).*dequantize.*load_weights now"):
        plan_folder(model, qwen3_moe_dir)


def test_the_cli_prints_a_refusal_as_one_error_line(tmp_path: pathlib.Path) -> None:
    """``lightning-zenflow fit`` under ``zenflow_fsdp`` on a folder the sharded reader refuses (a quantized GPT-OSS
    config): one ``error:`` line with the fix and exit status 2, no traceback (a rank of its own: a process group)."""
    folder = save_random_moe(tmp_path / "model", "gpt_oss")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "mxfp4"}}))
    command = [sys.executable, "-m", "lightning_zenflow.cli", "fit", "--trainer.strategy", "zenflow_fsdp"]
    command += ["--trainer.devices", "1", "--trainer.accelerator", "cpu", "--trainer.max_steps", "1"]
    command += ["--trainer.logger", "false", "--trainer.default_root_dir", str(tmp_path)]
    command += ["--model", "lightning_zenflow.llm.CausalLMFineTune", "--model.model_path", str(folder)]
    command += ["--data", "lightning_zenflow.llm.CausalLMDataModule", "--data.tokenizer_path", str(folder)]
    command += ["--data.data_path", str(write_text(tmp_path / "t.txt", 8, BLOCK_SIZE)), "--data.block_size", "16"]
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "LIGHTNING_ZENFLOW_DEBUG": "0"}
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=environment, timeout=240)
    assert done.returncode == 2, done.stderr[-4000:]
    assert "Traceback" not in done.stderr
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert re.search(r"quantization_config \(mxfp4\).*save_pretrained\(new_folder\).*load_weights now", error), error


# ------------------------------------------------------------------------------------------- the recipe's fit


def common_options(root: pathlib.Path) -> dict:
    """A tiny Qwen3-MoE and the text file, written into ``root``, and the options every fit shares (the dense fits'
    of ``tests/test_llm_distributed.py``)."""
    return {
        "entry": "llm_helpers:fit",
        "model_dir": str(save_random_qwen3_moe(root / "model")),
        "data_path": str(write_text(root / "corpus.txt", TRAIN_BLOCKS + VAL_BLOCKS, BLOCK_SIZE)),
        "block_size": BLOCK_SIZE,
        "val_fraction": VAL_FRACTION,
        "max_steps": STEPS,
        "lr": LR,
        "knobs": KNOBS,
    }


STRATEGIES = ("zenflow_ddp", "zenflow_fsdp")


@pytest.fixture(scope="module")
def fits(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The recipe on a Qwen3-MoE folder: both strategies on 2 ranks in one launch, then one process (``zenflow``) on
    the global batches they trained on."""
    root = tmp_path_factory.mktemp("moe_fits")
    common = common_options(root)
    two = {
        name: {**common, "strategy": name, "devices": 2, "batch_size": PER_RANK_BATCH, "sample_prompt": PROMPT}
        for name in STRATEGIES
    }
    results = launch_fits(root, two, world=2)
    ranks = results[STRATEGIES[0]]
    replay = [ranks[0]["batches"][step] + ranks[1]["batches"][step] for step in range(STEPS)]
    one = {**common, "strategy": "zenflow", "devices": 1, "batch_size": 2 * PER_RANK_BATCH, "replay": replay}
    (root / "zenflow").mkdir()
    results["zenflow"] = [fit(root / "zenflow", one)]
    datamodule = CausalLMDataModule(
        common["data_path"], common["model_dir"], block_size=BLOCK_SIZE, batch_size=2, val_fraction=VAL_FRACTION
    )
    datamodule.setup("fit")
    return {"root": root, "common": common, "results": results, "datamodule": datamodule}


@pytest.mark.parametrize("name", STRATEGIES)
def test_two_ranks_fit_an_moe_folder_as_one_process_and_export_it(fits: dict, name: str) -> None:
    ranks, (one,) = fits["results"][name], fits["results"]["zenflow"]
    for rank in ranks:
        assert (rank["world_size"], rank["global_step"]) == (2, STEPS)
        assert rank["sharded"] is (name == "zenflow_fsdp")
        assert rank["tied"]
    for step in range(STEPS):  # the one process replayed the global batches
        assert ranks[0]["batches"][step] + ranks[1]["batches"][step] == one["batches"][step], step
    assert_weights_equal(ranks[1]["weights"], ranks[0]["weights"])
    experts = "model.layers.0.mlp.experts.gate_up_proj"
    assert ranks[0]["weights"][experts].shape == (EXPERTS, 32, 32)
    original = transformers.AutoModelForCausalLM.from_pretrained(fits["common"]["model_dir"], dtype=torch.float32)
    assert not torch.equal(ranks[0]["weights"][experts], original.state_dict()[experts])  # the experts trained
    assert_close_up_to_adam_rounding(ranks[0]["weights"], one["weights"])
    assert ranks[0]["validations"][-1][1] == pytest.approx(one["validations"][-1][1], abs=1e-5)

    export_dir = fits["root"] / name / "export"
    assert tensors_of(export_dir).keys() == tensors_of(pathlib.Path(fits["common"]["model_dir"])).keys()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    assert_weights_equal({key: value.detach() for key, value in reloaded.named_parameters()}, ranks[0]["weights"])
    loader = fits["datamodule"].val_dataloader()
    assert mean_loss(reloaded, loader) == pytest.approx(ranks[0]["validations"][-1][1], abs=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export_dir)
    assert ranks[0]["sample"] == generate_sample(reloaded, tokenizer, PROMPT, 3)  # under FSDP2 from a whole copy


@pytest.mark.slow
def test_four_ranks_fsdp_fit_an_moe_folder_as_one_process(tmp_path: pathlib.Path) -> None:
    """``zenflow_fsdp`` on 4 ranks, each reading and training its block of 2 of the 8 experts, ends as one process
    trained on the same global batches (to AdamW's rounding: the sums over ranks are grouped otherwise)."""
    common = common_options(tmp_path)
    four = {**common, "strategy": "zenflow_fsdp", "devices": 4, "batch_size": 1}
    ranks = launch_fits(tmp_path, {"fsdp4": four}, world=4)["fsdp4"]
    replay = [sum((rank["batches"][step] for rank in ranks), []) for step in range(STEPS)]
    one = {**common, "strategy": "zenflow", "devices": 1, "batch_size": 4, "replay": replay}
    (tmp_path / "zenflow").mkdir()
    alone = fit(tmp_path / "zenflow", one)
    for rank in ranks:
        assert (rank["world_size"], rank["global_step"], rank["sharded"]) == (4, STEPS, True)
        assert_weights_equal(rank["weights"], ranks[0]["weights"])
    assert alone["batches"] == replay
    assert_close_up_to_adam_rounding(ranks[0]["weights"], alone["weights"])
    assert ranks[0]["validations"][-1][1] == pytest.approx(alone["validations"][-1][1], abs=1e-5)


@pytest.mark.slow
def test_two_ranks_fsdp_reading_their_experts_train_as_reading_the_whole_model(tmp_path: pathlib.Path) -> None:
    common = common_options(tmp_path)
    fsdp = {**common, "strategy": "zenflow_fsdp", "devices": 2, "batch_size": PER_RANK_BATCH}
    results = launch_fits(tmp_path, {"per_rank": fsdp, "whole": {**fsdp, "module": {"load_weights": "now"}}}, 2)
    for per_rank, whole in zip(results["per_rank"], results["whole"]):
        assert per_rank["batches"] == whole["batches"]
        assert per_rank["validations"] == whole["validations"]
        assert_weights_equal(per_rank["weights"], whole["weights"])
    for name in ("per_rank", "whole"):
        assert tensors_of(tmp_path / name / "export").keys() == tensors_of(pathlib.Path(common["model_dir"])).keys()
    assert_weights_equal(tensors_of(tmp_path / "per_rank" / "export"), tensors_of(tmp_path / "whole" / "export"))


@pytest.mark.slow
def test_a_sharded_checkpoint_of_an_moe_model_resumes_at_two_ranks_and_at_one(tmp_path: pathlib.Path) -> None:
    """A sharded checkpoint (the 3-D expert parameters' weights and ZenFlow state as DTensors of their global shape)
    written at 2 ranks inside an epoch and a host window: resumed at 2 ranks, the fit ends bitwise as the one not
    stopped; resumed at 1 rank (DCP reshards the experts' rows) on the global batches the 2 ranks trained on after the
    checkpoint, it ends as they did up to the rounding of averaging two half-batch gradients. The step-5 export
    (``export_on_checkpoint``, a group at a time) holds the checkpoint's weights, per expert."""
    common = common_options(tmp_path)
    every = {**common, "strategy": "zenflow_fsdp", "devices": 2, "batch_size": 1, "max_steps": RESUME_STEPS}
    every["knobs"] = {**RESUME_KNOBS, "checkpoint_format": "sharded"}
    checkpoint = tmp_path / "checkpointed" / "ckpt" / f"epoch=0-step={CHECKPOINT_EVERY}.ckpt"
    two = {
        "checkpointed": {**every, "checkpoint_every": CHECKPOINT_EVERY, "module": {"export_on_checkpoint": True}},
        "resumed": {**every, "ckpt_path": str(checkpoint)},
    }
    results = launch_fits(tmp_path, two, world=2)
    assert checkpoint.is_dir()
    for rank, (whole, rest) in enumerate(zip(results["checkpointed"], results["resumed"])):
        assert whole["global_step"] == rest["global_step"] == RESUME_STEPS
        assert rest["batches"] == whole["batches"][CHECKPOINT_EVERY:], f"rank {rank} resumed on other batches"
        assert_weights_equal(rest["weights"], whole["weights"])

    ranks = results["checkpointed"]
    replay = [ranks[0]["batches"][step] + ranks[1]["batches"][step] for step in range(RESUME_STEPS)]
    one = {**every, "devices": 1, "batch_size": 2, "replay": replay, "ckpt_path": str(checkpoint)}
    (resumed_at_one,) = launch_fits(tmp_path, {"at_one": one}, world=1)["at_one"]
    assert resumed_at_one["global_step"] == RESUME_STEPS
    assert resumed_at_one["batches"] == replay[CHECKPOINT_EVERY:]
    assert_close_up_to_adam_rounding(resumed_at_one["weights"], ranks[0]["weights"])

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(checkpoint, tmp_path / "step5.pt")
    saved = torch.load(tmp_path / "step5.pt", weights_only=False)["model"]
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "checkpointed" / "export" / f"step-{CHECKPOINT_EVERY}", dtype=torch.float32
    )
    for name, tensor in exported.state_dict().items():
        assert torch.equal(tensor, saved[f"model.{name}"]), name
