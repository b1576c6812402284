"""Private APIs of the installed libraries that mpp relies on: when an upgrade removes or changes
one, these fail by name instead of a run failing (or, worse, silently changing) later."""
from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from timm.models.vision_transformer import VisionTransformer


def test_accelerate_can_reset_its_state():
    # mpp.train.setup: a later train() in the same process may use another precision
    assert callable(getattr(AcceleratorState, "_reset_state", None)), \
        "accelerate no longer has AcceleratorState._reset_state; mpp.train.setup needs another way to reset"


def test_fused_optimizer_behind_accelerate_skips_a_step_on_found_inf():
    # mpp.train.loop sets `optimizer.optimizer.found_inf` to skip a non-finite step on the device
    AcceleratorState._reset_state()
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = Accelerator(cpu=True).prepare(torch.optim.AdamW([p], lr=0.1, fused=True))
    assert isinstance(optimizer.optimizer, torch.optim.AdamW)
    p.grad = torch.ones(3)
    optimizer.optimizer.found_inf = torch.ones(())
    optimizer.step()
    assert torch.equal(p.detach(), torch.ones(3)) and not optimizer.optimizer.state[p].get("step", 0)
    optimizer.optimizer.found_inf = torch.zeros(())
    optimizer.step()
    assert not torch.equal(p.detach(), torch.ones(3))
    AcceleratorState._reset_state()


def test_under_loss_scaling_a_step_whose_clipped_norm_is_not_finite_is_skipped_and_the_scale_lowered():
    # mpp.nonfinite.skip_unless_finite writes into GradScaler's private record of what unscaling found:
    # finite gradients whose norm overflows stepped (to NaN weights without clipping), the scale unlowered
    from mpp.nonfinite import skip_unless_finite
    for opt in (torch.optim.SGD, torch.optim.AdamW):  # fused, as mpp.optim makes every optimiser
        p = torch.nn.Parameter(torch.ones(3))
        optimizer = opt([p], lr=0.1, weight_decay=0.0, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale(torch.ones(()))       # the loss's scaling, which starts the scale
        p.grad = torch.full((3,), 1024.0)  # finite, scaled
        scaler.unscale_(optimizer)         # as Accelerator.clip_grad_norm_ does first
        skip_unless_finite(scaler, optimizer, torch.tensor(False))
        scaler.step(optimizer)
        scaler.update()
        assert torch.equal(p.detach(), torch.ones(3)) and scaler.get_scale() == 512.0, opt
        scaler.scale(torch.ones(()))
        p.grad = torch.full((3,), 512.0)
        scaler.unscale_(optimizer)
        skip_unless_finite(scaler, optimizer, torch.tensor(True))
        scaler.step(optimizer)
        scaler.update()
        assert torch.allclose(p.detach(), torch.full((3,), 0.9)) and scaler.get_scale() == 512.0, opt


def test_a_dataloader_iterator_reads_its_timeout_at_every_wait():
    # mpp.data.loader.ShardLoader sets its iterator's `_timeout`: the whole data.timeout for a
    # restart of the persistent workers, a watch of at most a minute for each item
    import itertools
    import time
    from torch.utils.data import DataLoader, IterableDataset

    class Slow(IterableDataset):
        def __iter__(self):
            for i in itertools.count():
                time.sleep(0.5 if i else 0)
                yield i
    it = iter(DataLoader(Slow(), batch_size=None, num_workers=1, timeout=30))
    assert it._timeout == 30 and next(it) == 0
    it._timeout = 0.1
    try:
        with pytest.raises(RuntimeError, match="DataLoader timed out after 0.1 seconds"):
            next(it)
        it._timeout = 30
        assert next(it) == 1  # nothing lost to the timed-out wait
    finally:
        it._shutdown_workers()


def test_timm_vit_keeps_the_steps_the_masked_encoder_calls():
    # mpp.models.MaskedEncoder.forward runs timm's forward_features steps itself
    for name in ("_pos_embed", "pool"):
        assert callable(getattr(VisionTransformer, name, None)), f"timm's VisionTransformer has no {name}"


def test_torchvision_randaugment_exposes_its_op_table_and_op():
    # mpp.data.transforms.TrainTransform._randaugment draws RandAugment's choices itself (not from
    # torch's global generator) and applies torchvision's own ops through these
    from torchvision.transforms import v2
    a = v2.RandAugment(num_ops=1, magnitude=5)
    missing = [n for n in ("_AUGMENTATION_SPACE", "_apply_image_or_video_transform", "_fill", "num_magnitude_bins",
                           "interpolation") if not hasattr(a, n)]
    assert not missing, f"torchvision's RandAugment no longer has {missing}; data.randaugment needs another way"
    magnitudes, signed = a._AUGMENTATION_SPACE["Rotate"]
    assert isinstance(signed, bool) and magnitudes(a.num_magnitude_bins, 32, 32).shape == (a.num_magnitude_bins,)


def test_torch_profiler_records_other_threads_when_asked():
    # mpp.profiling: the prefetch thread's phases are recorded through profile_all_threads
    import threading
    from torch.profiler import _ExperimentalConfig, profile, record_function

    def other():
        with record_function("other/thread"):
            torch.ones(2) + 1

    with profile(experimental_config=_ExperimentalConfig(profile_all_threads=True), acc_events=True) as p:
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert "other/thread" in {e.key for e in p.key_averages()}, \
        "torch's profiler no longer records other threads with _ExperimentalConfig(profile_all_threads=True)"
