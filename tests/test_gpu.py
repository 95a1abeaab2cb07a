"""GPU tests of the CUDA path: side stream, events, pinned host buffers, no host sync, equality with the CPU.

Skipped without CUDA. ``scripts/gpu_checks.sh`` runs them together with the GPU benchmark in one short run.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_zenflow.config import ZenFlowConfig, num_selected_columns
from lightning_zenflow.engine import ZenFlowEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.LayerNorm(96),
        torch.nn.GELU(),
        torch.nn.Linear(96, 48),
        torch.nn.Linear(48, 8),
    )
    return model.to(dtype)


def _optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}], lr=1e-3
    )


def _gradients(steps: int) -> list[dict[str, torch.Tensor]]:
    model = _model()
    generator = torch.Generator().manual_seed(1)
    stream = []
    for _ in range(steps):
        # column magnitudes change from step to step, so refreshes really move columns
        stream.append(
            {
                name: torch.randn(p.shape, generator=generator)
                * torch.rand(p.shape[-1:], generator=generator).pow(3).mul(4)
                for name, p in model.named_parameters()
            }
        )
    return stream


def _run(device: str, config: ZenFlowConfig, steps: int = 11, dtype: torch.dtype = torch.float32, **hooks) -> dict:
    model = _model(dtype).to(device)
    optimizer = _optimizer(model)
    names = {p: n for n, p in model.named_parameters()}
    with ZenFlowEngine(optimizer, config, param_names=names, **hooks) as engine:
        for grads in _gradients(steps):
            engine.wait_for_update()
            for name, p in model.named_parameters():
                p.grad = grads[name].to(device=device, dtype=dtype)
            engine.step()
        engine.flush()
        engine.wait_for_update()
        torch.cuda.synchronize() if device == "cuda" else None
        weights = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        state = engine.torch_state_dict()
    return {"weights": weights, "state": state}


CONFIGS = [
    ZenFlowConfig(topk_ratio=0.1, update_interval=3, select_strategy="step", select_interval=3),
    ZenFlowConfig(topk_ratio=0.5, update_interval=1, overlap_step=False),
    ZenFlowConfig(topk_ratio=0.0, update_interval=2, full_warm_up_rounds=2),
    ZenFlowConfig(topk_ratio=1.0, update_interval=4),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"rho{c.topk_ratio}-S{c.update_interval}")
def test_cuda_engine_equals_cpu_engine(config: ZenFlowConfig) -> None:
    on_cpu = _run("cpu", config)
    on_cuda = _run("cuda", config)
    for name, expected in on_cpu["weights"].items():
        torch.testing.assert_close(on_cuda["weights"][name], expected, atol=2e-6, rtol=1e-5, msg=name)
    for index, entry in on_cpu["state"]["state"].items():
        torch.testing.assert_close(on_cuda["state"]["state"][index]["exp_avg"], entry["exp_avg"], atol=1e-6, rtol=1e-5)


def test_side_stream_events_and_pinned_buffers() -> None:
    model = _model().cuda()
    names = {p: n for n, p in model.named_parameters()}
    with ZenFlowEngine(_optimizer(model), ZenFlowConfig(), param_names=names) as engine:
        updater = engine.device_updater
        assert updater.side_stream is not None
        assert updater.side_stream != torch.cuda.current_stream()
        assert isinstance(updater.update_done_event, torch.cuda.Event)
        for host in engine.host_buffers:
            # registered in place with cudaHostRegister: still shared, now also pinned
            assert host.block_shared.is_shared()
            assert host.block_shared.is_pinned()
        assert all(t.is_pinned() for t in engine.transfers._staging_pinned)


def test_no_host_synchronisation_on_the_hot_path() -> None:
    """Steps that are not refreshes, window ends included, make no synchronising CUDA call."""
    model = _model().cuda()
    names = {p: n for n, p in model.named_parameters()}
    config = ZenFlowConfig(topk_ratio=0.1, update_interval=2, select_strategy="step", select_interval=1000)
    with ZenFlowEngine(_optimizer(model), config, param_names=names) as engine:
        grads = _gradients(7)
        for step, step_grads in enumerate(grads):
            for name, p in model.named_parameters():
                p.grad = step_grads[name].cuda()
            engine.wait_for_update()
            if step == 0:
                engine.step()  # the first selection is a documented sync point
                continue
            torch.cuda.set_sync_debug_mode("error")
            try:
                stats = engine.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert not stats.refreshed
        engine.flush()


def test_device_memory_is_rho_times_12_bytes() -> None:
    model = _model().cuda()
    names = {p: n for n, p in model.named_parameters()}
    ratio = 0.25
    with ZenFlowEngine(_optimizer(model), ZenFlowConfig(topk_ratio=ratio), param_names=names) as engine:
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        engine.step()
        matrices = [p for p in model.parameters() if p.ndim >= 2]
        vectors = [p for p in model.parameters() if p.ndim < 2]
        selected_elements = sum(p.shape[0] * num_selected_columns(p[0].numel(), ratio) for p in matrices)
        expected = 12 * selected_elements + 8 * sum(p.numel() for p in vectors)
        index_bytes = sum(p[0].numel() * 8 for p in matrices)  # selected + unselected indices, int64
        assert engine.device_bytes() <= expected + index_bytes
        assert engine.device_bytes() >= expected
        engine.flush()


def test_slow_worker_is_bitwise_equal_on_cuda() -> None:
    config = ZenFlowConfig(topk_ratio=0.2, update_interval=2)
    fast = _run("cuda", config, steps=9)
    slow = _run("cuda", config, steps=9, host_delay_s=0.2)
    for name, weight in fast["weights"].items():
        assert torch.equal(slow["weights"][name], weight), name


def test_bf16_model_keeps_fp32_masters_on_cuda() -> None:
    config = ZenFlowConfig(topk_ratio=0.5, update_interval=2)
    bf16 = _run("cuda", config, dtype=torch.bfloat16)
    fp32 = _run("cpu", config)
    for name, weight in fp32["weights"].items():
        torch.testing.assert_close(bf16["weights"][name], weight, atol=2e-2, rtol=2e-2, msg=name)


def test_lightning_fit_bf16_true_on_cuda(tmp_path) -> None:
    import lightning as L

    import lightning_zenflow  # noqa: F401
    from lightning_zenflow.demo import ByteCorpusDataModule, CausalLMModule

    before = torch.cuda.memory_allocated()
    model = CausalLMModule(n_layer=2, n_embd=128, block_size=64, seed_model=0)
    data = ByteCorpusDataModule(block_size=64, batch_size=8, max_bytes=400_000, samples_per_epoch=400)
    trainer = L.Trainer(
        strategy="zenflow",
        accelerator="cuda",
        devices=1,
        precision="bf16-true",
        max_steps=40,
        limit_val_batches=2,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, data)
    assert trainer.callback_metrics["train_loss"] < 5.0
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    checkpoint = torch.load(tmp_path / "final.ckpt", weights_only=True)
    assert checkpoint["optimizer_states"][0]["state"][0]["exp_avg"].dtype == torch.float32
    del trainer, model
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before + 1024 * 1024


def test_cuda_resume_with_update_in_flight_is_exact() -> None:
    config = ZenFlowConfig(topk_ratio=0.2, update_interval=2)
    grads = _gradients(10)
    model = _model().cuda()
    names = {p: n for n, p in model.named_parameters()}
    reference = copy.deepcopy(model)
    with ZenFlowEngine(_optimizer(reference), config, param_names={p: n for n, p in reference.named_parameters()}) as e:
        for step_grads in grads:
            e.wait_for_update()
            for n, p in reference.named_parameters():
                p.grad = step_grads[n].cuda()
            e.step()
        e.flush()
    with ZenFlowEngine(_optimizer(model), config, param_names=names, host_delay_s=0.3) as first:
        for step_grads in grads[:4]:
            first.wait_for_update()
            for n, p in model.named_parameters():
                p.grad = step_grads[n].cuda()
            first.step()
        assert first.host_in_flight
        state = first.state_dict()
    resumed = copy.deepcopy(model)
    with ZenFlowEngine(
        _optimizer(resumed), config, param_names={p: n for n, p in resumed.named_parameters()}
    ) as second:
        second.load_state_dict(state)
        for step_grads in grads[4:]:
            second.wait_for_update()
            for n, p in resumed.named_parameters():
                p.grad = step_grads[n].cuda()
            second.step()
        second.flush()
        second.wait_for_update()
    for (name, p), q in zip(reference.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
