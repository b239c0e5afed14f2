"""The pin_memory shim against SGLang's real LoRA backend code (no engine)."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("sglang", reason="needs the SGLang venv (.venv-sglang: bash "
                    "scripts/bootstrap.sh --sglang)")

from deltaserve.hosts.sglang import compat

pytestmark = pytest.mark.sglang
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(),
                                   reason="the shim only acts where no CUDA device exists")


def _prefill_batch(lens: list[int]):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return types.SimpleNamespace(forward_mode=ForwardMode.EXTEND, batch_size=len(lens),
                                 extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
                                 extend_seq_lens_cpu=lens)


def _prepare(lens: list[int], weight_indices: list[int]):
    from sglang.srt.lora.backend.torch_backend import TorchNativeLoRABackend

    backend = TorchNativeLoRABackend(max_loras_per_batch=2, device=torch.device("cpu"))
    backend.prepare_lora_batch(_prefill_batch(lens), weight_indices, [8, 0], [2.0, 0.0],
                               use_cuda_graph=False)
    return backend.batch_info


@needs_no_cuda
def test_sglang_lora_batch_preparation_fails_without_the_shim():
    with pytest.raises(RuntimeError, match=r"NVIDIA driver|accelerator|CUDA"):
        _prepare([3, 2, 4], [0, 0, 1])


@needs_no_cuda
def test_shim_makes_sglang_lora_batch_preparation_work_and_exact():
    with compat.NoPinMemory():
        info = _prepare([3, 2, 4], [0, 0, 1])
    # segments of consecutive requests on one adapter, by hand: adapter 0 for 3 + 2 rows, then 1
    assert info.weight_indices_cpu.tolist() == [0, 1]
    assert info.seg_lens_cpu.tolist() == [5, 4]
    assert info.seg_indptr_cpu.tolist() == [0, 5, 9]
    assert info.lora_ranks_cpu.tolist() == [8, 0]
    assert info.scalings_cpu.tolist() == [2.0, 0.0]
    assert not info.seg_lens_cpu.is_pinned()


@needs_no_cuda
def test_shim_is_scoped_and_registered_on_every_lora_entry_point(monkeypatch):
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    with compat.NoPinMemory():
        assert torch.tensor([1, 2], pin_memory=True).tolist() == [1, 2]
        t = torch.zeros(2)
        assert t.pin_memory() is t
    with pytest.raises(RuntimeError):  # outside the mode torch is untouched
        torch.tensor([1, 2], pin_memory=True)

    registered: list[tuple[str, object, object]] = []
    monkeypatch.setattr(HookRegistry, "register",
                        classmethod(lambda cls, t, h, k: registered.append((t, h, k))))
    assert compat.register_pin_memory_shim()
    assert [t for t, _, _ in registered] == list(compat.LORA_ENTRY_POINTS)
    assert all(h is compat.without_pinning and k is HookType.AROUND for _, h, k in registered)
    monkeypatch.setenv(compat.SHIM_ENV, "0")
    assert not compat.register_pin_memory_shim()


def test_every_lora_entry_point_exists_in_this_sglang():
    import pkgutil

    for target in compat.LORA_ENTRY_POINTS:
        owner, attr = target.rsplit(".", 1)
        assert callable(getattr(pkgutil.resolve_name(owner), attr)), target
