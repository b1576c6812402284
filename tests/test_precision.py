"""train.precision=auto picks bf16 only where the device multiplies it natively: an AVX2-only CPU
emulates bf16 matmuls tens of times slower than fp32."""
from __future__ import annotations

import types

import pytest
import torch

from mpp import runtime
from mpp.config import ConfigError, load_config


@pytest.mark.parametrize("native, expected", [(True, "bf16"), (False, "no")])
def test_auto_on_cpu_follows_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda: native)
    assert runtime.resolve_precision("auto", "cpu") == expected
    assert runtime.resolve_precision("bf16", "cpu") == "bf16"  # an explicit choice is kept
    ctx = runtime.autocast(torch.device("cpu"), "auto")
    assert (getattr(ctx, "fast_dtype", None) == torch.bfloat16) == native


@pytest.mark.parametrize("avx512_bf16, amx, native", [(False, False, False), (True, False, True),
                                                     (False, True, True)])
def test_native_bf16_is_avx512_bf16_or_amx_not_any_avx512(monkeypatch, avx512_bf16, amx, native):
    """torch's `_is_mkldnn_bf16_supported` is true on any AVX-512 CPU (a Skylake or Ice Lake
    server, which has neither instruction set): auto picked bf16 there."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(runtime.platform, "machine", lambda: "x86_64")
    assert runtime.cpu_has_bf16() is native
    monkeypatch.setattr(runtime.platform, "machine", lambda: "aarch64")  # ARM: oneDNN's check is its bf16
    assert runtime.cpu_has_bf16() is True
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: False, raising=False)
    assert runtime.cpu_has_bf16() is False


def test_a_torch_without_the_private_checks_gets_no_bf16(monkeypatch):
    """torch's bf16 probes are private and may go: an absent one means no, so that auto never picks
    the emulated bf16 (tens of times slower than fp32) on a CPU it cannot ask."""
    monkeypatch.delattr(torch.cpu, "_is_avx512_bf16_supported", raising=False)
    monkeypatch.delattr(torch.cpu, "_is_amx_tile_supported", raising=False)
    monkeypatch.setattr(runtime.platform, "machine", lambda: "x86_64")
    assert runtime.cpu_has_bf16() is False
    monkeypatch.setattr(torch.ops, "mkldnn", types.SimpleNamespace())  # the op namespace finds any op on getattr
    monkeypatch.setattr(runtime.platform, "machine", lambda: "aarch64")
    assert runtime.cpu_has_bf16() is False


@pytest.mark.parametrize("precision, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_an_explicit_precision_autocasts_to_its_own_type(precision, dtype):
    assert runtime.autocast(torch.device("cpu"), precision).fast_dtype == dtype


def test_auto_on_cuda_and_other_devices(monkeypatch):
    def supported(native):  # a GPU with native bf16 (Ampere on), or one that only emulates it
        return lambda including_emulation=True: native or including_emulation
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported(False))
    assert runtime.resolve_precision("auto", "cuda") == "fp16"  # emulated bf16 is far slower than fp16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported(True))
    assert runtime.resolve_precision("auto", "cuda") == "bf16"
    monkeypatch.setattr(runtime, "cpu_has_bf16", lambda: True)  # the host's bf16 is not another device's
    assert runtime.resolve_precision("auto", "mps") == "no"


def test_precision_config_values():
    assert load_config(None, ["train.precision=no"]).train.precision == "no"  # YAML 1.1 would read false
    assert load_config(None, []).train.precision == "auto"
    with pytest.raises(ConfigError, match="train.precision"):
        load_config(None, ["train.precision=fp8"])
