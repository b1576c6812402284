"""mpp.compiled: the compiled step equals eager and compiles once for every batch size."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from mpp.compiled import AUTO_MIN_STEPS, compile_task, use_compile
from mpp.config import Config
from mpp.models import create_encoder
from mpp.objectives import build_task

pytestmark = pytest.mark.slow


def test_use_compile():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert use_compile("auto", cuda, AUTO_MIN_STEPS) and not use_compile("auto", cpu, 10**6)
    assert not use_compile("auto", cuda, AUTO_MIN_STEPS - 1)  # too short to win the compile back
    assert use_compile("always", cpu, 1) and not use_compile("never", cuda, 10**6)


@pytest.fixture
def eager_random():
    """Compiled code draws eager's random numbers. Inductor's own patcher, not monkeypatch: on
    torch 2.11 monkeypatch's undo deleted the setting, failing the next test."""
    with torch._inductor.config.patch(fallback_random=True):
        yield


@pytest.mark.parametrize("objective,mode", [
    ("mpp", "default"), ("classify", "default"),
    pytest.param("mpp", "reduce-overhead", marks=pytest.mark.skipif(
        not torch.cuda.is_available(), reason="reduce-overhead replays CUDA graphs; on CPU it compiles as default"))])
def test_compiled_step_equals_eager_without_recompiles(objective, mode, eager_random):
    """On CUDA where there is one (reduce-overhead then replays CUDA graphs), else on CPU."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.reset()
    counters.clear()
    cfg = Config(objective=objective)
    torch.manual_seed(0)
    task = build_task(cfg, create_encoder("vit_micro4_32", attn="auto"), 10 if objective != "mpp" else None).to(device)
    step = compile_task(task, mode)
    for batch in (8, 5, 3):  # a full batch, then the smaller tail batches of an epoch
        images = torch.randint(0, 256, (batch, 3, 32, 32), dtype=torch.uint8, device=device)
        labels = torch.randint(0, 10, (batch,), device=device) if objective != "mpp" else None
        results = []
        for run in (task, step):
            torch.manual_seed(batch)  # the same corruption draw
            task.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss, metrics = run(images, labels)
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in task.parameters() if p.grad is not None]))
        (eager_loss, eager_grads), (loss, grads) = results
        torch.testing.assert_close(loss, eager_loss, rtol=2e-2, atol=2e-2)
        assert len(grads) == len(eager_grads)
        for g, e in zip(grads, eager_grads):
            torch.testing.assert_close(g, e, rtol=5e-2, atol=5e-3)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # one graph for all three batch sizes


def test_the_first_compiled_step_takes_the_devices_attention_path(monkeypatch):
    """A run's first step is a compiled one (no eager forward before it): it must be traced on
    the device's attention path ('auto': fused on CUDA, stood in for here), or the first eager
    forward (a periodic evaluation) switches the path and the step recompiles mid-run."""
    from mpp import models
    torch._dynamo.reset()
    counters.clear()
    task = build_task(Config(objective="mpp"), create_encoder("vit_micro4_32", attn="auto"), None)
    assert not any(m.fused_attn for m in task.encoder._attn_modules)  # built for the CPU rule
    monkeypatch.setitem(models.ATTENTION, "auto", lambda device_type: True)
    step = compile_task(task)
    images = torch.randint(0, 256, (8, 3, 32, 32), dtype=torch.uint8)
    step(images)[0].backward()
    assert all(m.fused_attn for m in task.encoder._attn_modules)
    with torch.no_grad():
        task.encoder(torch.randn(2, 3, 32, 32))  # an eager forward, e.g. a periodic few-shot evaluation
    step(images)[0].backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]


@pytest.mark.parametrize("mode, refused", [("reduce-overhead", True), ("max-autotune", True), ("default", False),
                                           ("max-autotune-no-cudagraphs", False)])
def test_modes_that_record_cuda_graphs_are_refused_with_gradient_accumulation(mode, refused):
    """A CUDA graph replays into the same gradient buffers: a micro-batch's gradients would be
    overwritten before the next is added."""
    from mpp.config import ConfigError, load_config
    overrides = ["output_dir=x", "batch_size=4", "train.grad_accum=2", f"train.compile_mode={mode}"]
    if refused:
        with pytest.raises(ConfigError, match="CUDA graphs overwrite"):
            load_config(None, overrides)
    else:
        assert load_config(None, overrides).train.compile_mode == mode
