"""CoatAdamW(step_in_backward=True): the update runs in backward, gradients are freed there,
and training is the normal step's, bit for bit where the scheme is the same."""
from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.nn as nn

from coat_ds import CoatAdamW, compress_activations
from coat_ds.memory.meters import StorageMeter
from coat_ds.optim import in_backward

transformers = pytest.importorskip("transformers")

OPT = dict(lr=1e-2, weight_decay=0.1, min_quant_numel=256, group_size=32)


def _llama(seed=0, tie=False, vocab=512):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=tie, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def _batches(n, vocab=512, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 16), generator=g) for _ in range(n)]


def _loss(model, x):
    return model(input_ids=x, labels=x).loss


def _train(model, opt, batches, clip=None, accumulate=1):
    norms = []
    dev = next(model.parameters()).device
    for x in batches:
        x = x.to(dev)
        for i in range(accumulate):
            with opt.accumulating() if i < accumulate - 1 else contextlib.nullcontext():
                (_loss(model, x) / accumulate).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _same_params(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name


def _same_state(oa: CoatAdamW, ob: CoatAdamW) -> None:
    for pa, pb in zip(oa.param_groups[0]["params"], ob.param_groups[0]["params"]):
        sa, sb = oa.state[pa], ob.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bucket", [None, 5000])
def test_equals_step_bitwise(backend, bucket, monkeypatch, device):
    """Five steps of a small Llama: the same parameters and moments as step(), bit for bit,
    whether each backward steps in one bucket or in several (Triton: interpreted on a CPU;
    on a GPU, with the side stream)."""
    if bucket is not None:
        monkeypatch.setattr(in_backward, "BUCKET_NUMEL", bucket)
    a = _llama().to(device if backend == "triton" else "cpu")
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), backend=backend, **OPT)
    ob = CoatAdamW(b.parameters(), backend=backend, step_in_backward=True, **OPT)
    batches = _batches(5)
    _train(a, oa, batches)
    _train(b, ob, batches)
    _same_params(a, b)
    _same_state(oa, ob)


def test_no_gradient_after_backward_and_its_bytes_gone():
    """After backward every trained parameter's .grad is None, and the storages alive are
    smaller than the normal mode's by >= 3.9 bytes per FP32 parameter; with clipping, whose
    BF16 copies wait for step(), by >= 1.9."""
    alive = {}
    for mode, clip in ((False, None), (True, None), (True, 1.0)):
        model = _llama()
        opt = CoatAdamW(model.parameters(), step_in_backward=mode, max_grad_norm=clip, **OPT)
        x = _batches(2)
        _train(model, opt, x[:1])  # moments exist from here on
        loss = _loss(model, x[1])
        meter = StorageMeter()
        meter.start()
        loss.backward()
        meter.stop()
        alive[mode, clip] = meter.now
        grads = [p.grad for p in model.parameters()]
        assert all(g is None for g in grads) if mode else all(g is not None for g in grads)
    numel = sum(p.numel() for p in _llama().parameters())
    assert alive[False, None] - alive[True, None] >= 3.9 * numel, (alive, numel)
    assert alive[False, None] - alive[True, 1.0] >= 1.9 * numel, (alive, numel)


def test_tied_weights_step_once_per_backward():
    """A tied embedding/head gets one update per backward, with both uses' gradient."""
    a = _llama(tie=True)
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, **OPT)
    batches = _batches(3)
    _train(a, oa, batches)
    _train(b, ob, batches)
    _same_params(a, b)
    assert float(ob.state[b.model.embed_tokens.weight]["step"]) == 3


def test_accumulation_steps_on_the_last_micro_batch():
    a = _llama()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, **OPT)
    batches = _batches(3)
    _train(a, oa, batches, accumulate=3)
    _train(b, ob, batches, accumulate=3)
    _same_params(a, b)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_clipping_is_clip_then_step_on_bf16_gradients_bitwise(backend, device):
    """With max_grad_norm the update waits for step() on BF16 copies of the gradients (the
    FP32 ones freed in backward), scaled by clip_grad_norm_'s coefficient for the FP32
    gradients' norm: bit for bit step() after clipping BF16-rounded gradients by hand."""
    dev = device if backend == "triton" else "cpu"
    a = _llama().to(dev)
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), backend=backend, **OPT)
    ob = CoatAdamW(b.parameters(), backend=backend, step_in_backward=True, max_grad_norm=0.5, **OPT)
    coefs = []
    for x in _batches(4):
        x = x.to(dev)
        _loss(b, x).backward()
        assert all(p.grad is None for p in b.parameters())
        ob.step()
        _loss(a, x).backward()  # the same parameters, so the same gradients
        norm = torch.nn.utils.clip_grad_norm_(a.parameters(), float("inf"))
        assert torch.allclose(ob.last_grad_norm(), norm, rtol=1e-6)
        coef = (0.5 / (ob.last_grad_norm() + 1e-6)).clamp(max=1.0)
        for p in a.parameters():
            p.grad = p.grad.bfloat16().float() * coef
        oa.step()
        oa.zero_grad()
        _same_params(a, b)
        coefs.append(float(coef))
    assert max(coefs) < 1.0, "the test clips"
    _same_state(oa, ob)


def test_nonfinite_gradient_skips_its_groups_as_step_does():
    a = _llama()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, **OPT)
    for model, opt in ((a, oa), (b, ob)):
        w = model.model.layers[0].mlp.up_proj.weight
        h = w.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("nan")))
        _train(model, opt, _batches(1))
        h.remove()
        _train(model, opt, _batches(1, seed=2))
    _same_params(a, b)
    assert oa.nonfinite_groups() == ob.nonfinite_groups() > 0
    assert all(torch.isfinite(p).all() for p in b.parameters())


def test_clipping_with_a_nonfinite_gradient_skips_the_step_as_clip_then_step_does():
    """A NaN anywhere makes the global norm, and so clip_grad_norm_'s coefficient, NaN: every
    group of that step is skipped (nothing changes, nothing poisoned), and the next step is
    the clipped step as usual."""
    a = _llama()
    b = copy.deepcopy(a)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, max_grad_norm=0.5, **OPT)
    _train(b, ob, _batches(1))
    before = copy.deepcopy(b.state_dict())
    w = b.model.layers[0].mlp.up_proj.weight
    h = w.register_hook(lambda g: g.index_fill(0, torch.tensor([3]), float("nan")))
    _train(b, ob, _batches(1, seed=2))
    h.remove()
    assert torch.isnan(ob.last_grad_norm())
    for k, v in b.state_dict().items():
        assert torch.equal(v, before[k]), k
    skipped = ob.nonfinite_groups()
    assert skipped > 0
    _train(b, ob, _batches(1, seed=3))
    assert ob.nonfinite_groups() == skipped and torch.isfinite(ob.last_grad_norm())
    assert all(torch.isfinite(p).all() for p in b.parameters())
    assert any(not torch.equal(v, before[k]) for k, v in b.state_dict().items())


def test_raise_mode_keeps_its_gradients_for_step_and_updates_nothing():
    model = _llama()
    with pytest.warns(RuntimeWarning, match="nonfinite='raise'"):
        opt = CoatAdamW(model.parameters(), step_in_backward=True, nonfinite="raise", **OPT)
    before = copy.deepcopy(model.state_dict())
    w = model.model.layers[1].self_attn.q_proj.weight
    h = w.register_hook(lambda g: torch.full_like(g, float("inf")))
    _loss(model, _batches(1)[0]).backward()
    h.remove()
    assert all(p.grad is not None for p in model.parameters()), "kept for step()"
    with pytest.raises(FloatingPointError, match="non-finite gradient"):
        opt.step()
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_resume_continues_bitwise(tmp_path):
    """A state dict saved after step 2 (clipping on) and loaded into a fresh model and
    optimizer continues exactly as the run that did not stop."""
    batches = _batches(4)
    a = _llama()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), step_in_backward=True, max_grad_norm=0.5, **OPT)
    _train(a, oa, batches)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, max_grad_norm=0.5, **OPT)
    _train(b, ob, batches[:2])
    torch.save({"model": b.state_dict(), "optim": ob.state_dict()}, tmp_path / "ck.pt")
    c = _llama(seed=5)
    oc = CoatAdamW(c.parameters(), step_in_backward=True, max_grad_norm=0.5, **OPT)
    saved = torch.load(tmp_path / "ck.pt", weights_only=True)
    c.load_state_dict(saved["model"])
    oc.load_state_dict(saved["optim"])
    _train(c, oc, batches[2:])
    _same_params(a, c)


def test_compiled_model_with_compressed_activations_matches_step():
    a = _llama()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, **OPT)
    for model in (a, b):
        for layer in model.model.layers:
            compress_activations(layer)
            layer.compile()
    batches = _batches(3)
    _train(a, oa, batches)
    _train(b, ob, batches)
    _same_params(a, b)


def test_refusals():
    p = nn.Parameter(torch.randn(8, 8))
    with pytest.raises(ValueError, match="max_grad_norm is for step_in_backward=True"):
        CoatAdamW([p], max_grad_norm=1.0)
    with pytest.raises(ValueError, match="max_grad_norm must be a finite number > 0"):
        CoatAdamW([p], step_in_backward=True, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="step_in_backward must be True or False"):
        CoatAdamW([p], step_in_backward="yes")


def test_without_the_end_of_backward_callback_step_finishes_the_job(monkeypatch):
    """Where torch has no end-of-backward callback the last bucket is stepped in step(),
    with a warning; training is unchanged."""
    from coat_ds import _compat
    monkeypatch.setattr("coat_ds._compat.torch._engine_queue_callback", None)
    monkeypatch.setattr(_compat, "_WARNED", set())
    a = _llama()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, **OPT)
    _train(a, oa, _batches(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(b, ob, _batches(2))
    assert sum("queue_callback" in str(w.message) for w in caught) == 1
    _same_params(a, b)


@pytest.mark.gpu
def test_cuda_side_stream_equals_step_and_frees_the_gradients():
    """On a GPU the update runs on a side stream through the Triton kernel: the same
    parameters as step(), and after backward the allocator holds >= 3.9 bytes per parameter
    less than the normal mode."""
    a = _llama().cuda()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, **OPT)
    held = {}
    for x in _batches(4):
        x = x.cuda()
        for model, opt in ((a, oa), (b, ob)):
            loss = _loss(model, x)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss.backward()
            torch.cuda.synchronize()
            held[opt is ob] = torch.cuda.memory_allocated() - before
            opt.step()
            opt.zero_grad()
    _same_params(a, b)
    numel = sum(p.numel() for p in a.parameters())
    assert held[False] - held[True] >= 3.9 * numel, (held, numel)
