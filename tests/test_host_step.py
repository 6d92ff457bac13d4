"""The host (ZeRO-Offload / CPU) AdamW step's fallback: the reference step over group-aligned
chunks, what runs where the fused C++ kernel did not build (tests/test_host_kernel.py tests
the kernel)."""
from __future__ import annotations

import copy

import pytest
import torch

import coat_ds
from coat_ds.kernels import AdamWHyper, AdamWSlot, QuantizedGroups, get, group_layout, host, host_native
from coat_ds.kernels import reference as R


def _slot(shape, seed, quant=True, pdt=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda: torch.randn(shape, generator=g)  # noqa: E731
    p = (rnd() * 0.02).to(pdt)
    if quant:
        m, v = R.quantize_groups(rnd() * 1e-3), R.quantize_groups(rnd().square() * 1e-6)
    else:
        m, v = rnd() * 1e-3, rnd().square() * 1e-6
    return AdamWSlot(p, torch.zeros_like(p), m, v)


def _tensors(slot):
    out = [slot.param]
    for mom in (slot.exp_avg, slot.exp_avg_sq):
        out.extend(mom if isinstance(mom, QuantizedGroups) else [mom])
    return out


# (shape, chunk_elems): a flat partition with a short last group; rows longer than a chunk
# (cut inside rows); short rows (runs of whole rows); rows whose length is not a multiple of G.
CASES = [((10_000 + 37,), 1024), ((3, 5000), 1024), ((40, 256), 1024), ((50, 130), 512)]


@pytest.mark.parametrize("shape,chunk", CASES)
def test_chunks_are_views_tiling_every_group_once(shape, chunk):
    slot = _slot(shape, 0)
    parts = host.chunk_slots(slot, 128, chunk)
    assert len(parts) > 1
    assert sum(p.param.numel() for p in parts) == slot.param.numel()
    assert sum(p.exp_avg.center.numel() for p in parts) == slot.exp_avg.center.numel()
    for part in parts:
        assert part.param.numel() <= chunk
        lay = group_layout(part.param.shape, 128)
        assert part.exp_avg.center.shape == lay.meta_shape
        assert part.exp_avg.codes.shape == part.param.shape
        for t, whole in zip(_tensors(part), _tensors(slot)):
            assert t.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()  # a view, no copy


@pytest.fixture
def chunked_reference(monkeypatch):
    monkeypatch.setattr(host_native, "library", lambda: None)  # as where the kernel did not build


@pytest.fixture
def two_threads():
    n = torch.get_num_threads()
    torch.set_num_threads(2)  # the threaded path, also where CI has one core
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("shape,chunk", CASES)
@pytest.mark.parametrize("quant,pdt", [(True, torch.float32), (True, torch.bfloat16), (False, torch.float32)])
def test_chunked_step_equals_whole_reference_bitwise(chunked_reference, two_threads, shape, chunk, quant, pdt):
    a = _slot(shape, 1, quant, pdt)
    b = copy.deepcopy(a)
    skipped_a, skipped_b = torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64)
    g = torch.Generator().manual_seed(2)
    for step in range(1, 4):
        grad = (torch.randn(shape, generator=g) * 1e-3).to(pdt)
        if step == 2:
            grad.view(-1)[5] = float("nan")  # a skipped group, counted by both
            grad.view(-1)[-1] = float("inf")
        a.grad.copy_(grad)
        b.grad.copy_(grad)
        hyper = AdamWHyper.at_step(step, 1e-3, 0.9, 0.999, 1e-8, 0.01)
        R.adamw_step([a], hyper, skipped=skipped_a)
        host.host_step([b], hyper, skipped=skipped_b, chunk_elems=chunk)
    for x, y in zip(_tensors(a), _tensors(b)):
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    assert skipped_a.item() == skipped_b.item() == 2


def test_offloaded_step_hands_the_reference_at_most_a_chunk(monkeypatch, chunked_reference, two_threads):
    """Transient memory of the host step is the reference step's on at most `workers` chunks:
    the reference, which allocates ~10 FP32 temporaries of its input, never sees more."""
    seen = []
    real = R.adamw_step

    def spy(slots, *args, **kwargs):
        seen.extend(s.param.numel() for s in slots)
        return real(slots, *args, **kwargs)

    monkeypatch.setattr(host, "adamw_step", spy)
    p = torch.nn.Parameter(torch.randn(300_000) * 0.02)
    opt = coat_ds.CoatAdamW([p], lr=1e-3)
    p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    assert get("adamw", p.device).step is host.host_step
    assert sum(seen) == p.numel() and max(seen) <= host.HOST_CHUNK_ELEMS
