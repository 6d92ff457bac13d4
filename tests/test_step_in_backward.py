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
    smaller than the normal mode's by >= 3.9 bytes per FP32 parameter."""
    alive = {}
    for mode in (False, True):
        model = _llama()
        opt = CoatAdamW(model.parameters(), step_in_backward=mode, **OPT)
        x = _batches(2)
        _train(model, opt, x[:1])  # moments exist from here on
        loss = _loss(model, x[1])
        meter = StorageMeter()
        meter.start()
        loss.backward()
        meter.stop()
        alive[mode] = meter.now
        grads = [p.grad for p in model.parameters()]
        assert all(g is None for g in grads) if mode else all(g is not None for g in grads)
    numel = sum(p.numel() for p in _llama().parameters())
    assert alive[False] - alive[True] >= 3.9 * numel, (alive, numel)


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


def test_clipping_uses_the_previous_steps_norm():
    """Step k >= 2 scales its gradients by min(1, c / (norm of step k-1 + 1e-6)); step 1 runs
    unclipped and then has its moments scaled as clipping by its own norm would have. So it
    follows clipping by hand with those coefficients (step 1 exactly clipped): the two differ
    only by eps in step 1's update, then by FP8 rounding; the norm it reports is torch's for
    its own gradients."""
    a = _llama()
    b = copy.deepcopy(a)
    start = [p.detach().clone() for p in a.parameters()]
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, max_grad_norm=0.5, **OPT)
    coef = None
    for x in _batches(4):
        _loss(a, x).backward()
        grads = [p.grad for p in a.parameters()]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        for g in grads:
            g.mul_((0.5 / (norm + 1e-6)).clamp(max=1.0) if coef is None else coef)
        oa.step()
        oa.zero_grad()
        _loss(b, x).backward()
        ob.step()
        if coef is None:  # the same parameters, so the same gradients
            assert torch.allclose(ob.last_grad_norm(), norm, rtol=1e-6)
        coef = (0.5 / (ob.last_grad_norm() + 1e-6)).clamp(max=1.0)
    assert float(coef) < 1.0, "the test clips"
    gap = sum(float((p - q).norm() ** 2) for p, q in zip(a.parameters(), b.parameters())) ** 0.5
    moved = sum(float((p - s).norm() ** 2) for p, s in zip(a.parameters(), start)) ** 0.5
    assert gap <= 0.05 * moved, (gap, moved)


def test_first_step_moments_are_those_of_a_clipped_step():
    """Without the first step's correction its unclipped moments would scale every later
    update down (checked: the corrected moments are the clipped step's, to FP8 rounding)."""
    a = _llama()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, max_grad_norm=0.1, **OPT)
    x = _batches(1)[0]
    _loss(a, x).backward()
    norm = float(torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1))
    assert norm > 1.0, "the first step clips hard"
    oa.step()
    _loss(b, x).backward()
    ob.step()
    fa, fb = oa.fp32_state_dict()["state"], ob.fp32_state_dict()["state"]
    for k in fa:
        for name in ("exp_avg", "exp_avg_sq"):
            ref = fa[k][name]
            assert (fb[k][name] - ref).norm() <= 0.01 * ref.norm(), (k, name)


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
    with pytest.raises(ValueError, match="max_grad_norm clips inside backward"):
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
    """On a GPU the update runs on a side stream through the Triton kernel, with clipping:
    the same parameters as step() with the same coefficients, and after backward the
    allocator holds >= 3.9 bytes per parameter less than the normal mode."""
    a = _llama().cuda()
    b = copy.deepcopy(a)
    oa = CoatAdamW(a.parameters(), **OPT)
    ob = CoatAdamW(b.parameters(), step_in_backward=True, max_grad_norm=0.5, **OPT)
    coef = torch.tensor(1.0, device="cuda")
    held = {}
    for i, x in enumerate(_batches(4)):
        x = x.cuda()
        for model, opt in ((a, oa), (b, ob)):
            loss = _loss(model, x)
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            loss.backward()
            torch.cuda.synchronize()
            held[opt is ob] = torch.cuda.memory_allocated() - before
            if opt is oa:
                for p in model.parameters():
                    p.grad.mul_(coef)
            opt.step()
            opt.zero_grad()
        coef = (0.5 / (ob.last_grad_norm() + 1e-6)).clamp(max=1.0)
    assert float(coef) < 1.0
    _same_params(a, b)
    numel = sum(p.numel() for p in a.parameters())
    assert held[False] - held[True] >= 3.9 * numel, (held, numel)
