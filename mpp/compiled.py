"""`train.compile`: the Task's forward (and through AOTAutograd its backward) under torch.compile.

One graph per task, no graph breaks (the attention "auto" rule is applied for the model's device
before the first trace and not re-applied while tracing, see mpp.models), and the batch dimension
is dynamic, so an epoch's smaller tail batches and a resumed run reuse the compiled graph instead
of recompiling (a batch of one specialises, and a tail batch on the other side of a size inductor
guards on compiles once more: on CPU, a sum over more than 4,096 rows). "auto" compiles CUDA runs of at least
AUTO_MIN_STEPS steps (the whole run's, so a resumed run decides as the run did): about where the
fused kernels and fewer launches pay for the compile time. A shorter run (the fine-tunes and probes of
a comparison's many stages) would spend longer compiling than stepping eagerly, and on CPU the
compile takes minutes for a gain that short runs never recover: both run eagerly unless asked
(figures in docs/benchmarks.md).
`train.compile_mode` is torch.compile's mode; "reduce-overhead" also replays the step as CUDA graphs
(one launch instead of hundreds: for small models, where launch overhead dominates).
"""
from __future__ import annotations

from typing import Callable

import torch

from mpp.models import MaskedEncoder


# "auto": the steps a CUDA run must have. About where the models timed win their compile time back:
# a larger model sooner, a small one (Ti/4) later, later still when an epoch's tail batch
# recompiles (docs/benchmarks.md)
AUTO_MIN_STEPS = 4000

# train.compile -> whether the step is compiled on a device type for a run of so many steps
COMPILE = {"auto": lambda device_type, steps: device_type == "cuda" and steps >= AUTO_MIN_STEPS,
           "always": lambda device_type, steps: True,
           "never": lambda device_type, steps: False}


# train.compile_mode -> whether torch.compile's mode records CUDA graphs (on CUDA only; elsewhere ignored)
COMPILE_MODES = {"default": False, "reduce-overhead": True, "max-autotune": True, "max-autotune-no-cudagraphs": False}


def use_compile(setting: str, device: torch.device, steps: int) -> bool:
    """Whether `train.compile` (a mode of COMPILE) compiles a run of `steps` steps on `device`."""
    return COMPILE[setting](device.type, steps)


def compile_task(model: torch.nn.Module, mode: str = "default") -> Callable:
    """`model(images[, labels]) -> (loss, metrics)` compiled, with the batch dimension dynamic.
    With CUDA graphs every call starts a new step: the caller has consumed the outputs of the last
    one (loss backwarded, metrics added into its own sums) before the graph overwrites them."""
    device_type = next(model.parameters()).device.type
    for m in model.modules():  # the attention path of the device, before tracing fixes one
        if isinstance(m, MaskedEncoder):
            m.choose_attention(device_type)
    compiled = torch.compile(model, mode=mode)
    graphs = COMPILE_MODES[mode]

    def forward(images: torch.Tensor, labels: torch.Tensor | None = None):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        torch._dynamo.maybe_mark_dynamic(images, 0)
        if labels is None:
            return compiled(images)
        torch._dynamo.maybe_mark_dynamic(labels, 0)
        return compiled(images, labels)

    return forward
