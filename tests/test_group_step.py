"""CoatAdamW's prepared group step (coat_ds/optim/group_step.py): reused while nothing it relied on
changed, rebuilt (or bypassed) whenever something did. Every test changes one thing between
steps and compares with an optimizer that never saw a prepared step for it: a stale prepared
step gives other values. Triton backend, small tensors: through the interpreter on CPU, the
real kernels where a GPU is present (CPU tensors there would take the host step instead)."""
import os
import sys

import pytest
import torch

import coat_ds
from coat_ds import CoatAdamW
from coat_ds.kernels import adamw, fp8, set_fp8_conversions

COAT_DIR = os.path.dirname(coat_ds.__file__)

LR = 1e-2
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _params(seed=0, shapes=((16, 128), (64,), (8, 128))):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.02).to(DEV)) for s in shapes]


def _grad(p, seed):
    g = torch.Generator().manual_seed(seed * 1000 + p.numel())
    return (torch.randn(p.shape, generator=g) * 1e-2).to(DEV)


def _opt(params, **kw):
    # min_quant_numel=1024: the (16, 128) and (8, 128) tensors in FP8, the bias in FP32.
    return CoatAdamW(params, lr=LR, backend="triton", min_quant_numel=1024, **kw)


def _step(opt, params, seed, skip=()):
    for i, p in enumerate(params):
        if i in skip:
            p.grad = None
        elif p.grad is None:
            p.grad = _grad(p, seed)
        else:
            p.grad.copy_(_grad(p, seed))  # same buffers: the gradient addresses stay
    opt.step()


def _same(pa, opt_a, pb, opt_b):
    for p, q in zip(pa, pb):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


def _twin(params, opt, **kw):
    """A fresh optimizer (nothing prepared) on copies of `params`, with `opt`'s state."""
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = _opt(copies, **kw)
    fresh.load_state_dict(opt.state_dict())
    return copies, fresh


def test_steady_steps_build_nothing_and_moved_gradients_are_followed(monkeypatch):
    """One GroupStep for many steps; gradients replaced by new tensors (new addresses, as
    zero_grad(set_to_none=True) gives) are what the next step reads."""
    built, prepare = [], CoatAdamW._prepare
    monkeypatch.setattr(CoatAdamW, "_prepare", lambda self, *args: built.append(1) or prepare(self, *args))
    pa, pb = _params(), _params()
    a, b = _opt(pa), _opt(pb)
    kept = []
    for s in range(4):
        _step(a, pa, s)
        for p in pb:
            kept.append(p.grad)  # the old gradient stays alive: the new one lands elsewhere
            p.grad = _grad(p, s)
        b.step()
    assert len(built) == 2
    _same(pa, a, pb, b)
    assert [float(b.state[p]["step"]) for p in pb] == [4.0] * 3


@pytest.mark.parametrize("change", ["replaced", "data_swapped", "param_data_swapped"])
def test_changed_state_or_parameter_storage_is_what_the_next_step_writes(change):
    pa = _params()
    a = _opt(pa)
    for s in range(2):
        _step(a, pa, s)
    pb, b = _twin(pa, a)
    _step(b, pb, 2)
    keep = []
    w = pa[0]
    if change == "replaced":
        for key in ("exp_avg_codes", "exp_avg_sq_center", "group_skips"):
            a.state[w][key] = a.state[w][key].clone()
    elif change == "data_swapped":
        for key in ("exp_avg_sq_codes", "exp_avg_kcode"):
            keep.append(a.state[w][key].data)
            a.state[w][key].data = a.state[w][key].data.clone()
    else:
        keep.append(w.data)
        w.data = w.data.clone()
    _step(a, pa, 2)
    _same(pa, a, pb, b)


def test_empty_parameter_in_the_group_is_stepped_around():
    """An empty tensor (an FSDP2 shard can be one) has no row in the launch."""
    pa, pb = _params(), _params()
    a, b = _opt([torch.nn.Parameter(torch.empty(0, 64, device=DEV))] + pa), _opt(pb)
    for s in range(3):
        _step(a, a.param_groups[0]["params"], s)
        _step(b, pb, s)
    _same(pa, a, pb, b)


def test_state_value_that_is_not_a_tensor_is_kept_and_stepped_around():
    pa = _params()
    a = _opt(pa)
    _step(a, pa, 0)
    pb, b = _twin(pa, a)
    a.state[pa[0]]["note"] = "kept"
    for s in (1, 2):
        _step(a, pa, s)
        _step(b, pb, s)
    assert a.state[pa[0]].pop("note") == "kept"
    _same(pa, a, pb, b)


def test_step_counter_set_by_hand_is_the_one_that_counts():
    pa = _params()
    a = _opt(pa)
    _step(a, pa, 0)
    a.state[pa[0]]["step"] = torch.tensor(7.0)  # replaced
    a.state[pa[2]]["step"].fill_(5.0)  # in place
    pb, b = _twin(pa, a)
    _step(a, pa, 1)
    _step(b, pb, 1)
    assert [float(a.state[p]["step"]) for p in pa] == [8.0, 2.0, 6.0]
    _same(pa, a, pb, b)


def test_parameter_lists_swapped_between_steps_keep_their_own_state():
    """ZeRO-3 with sub-groups puts another tensor list in the param group at each step()."""
    one, two = _params(0, ((16, 128),)), _params(1, ((8, 128), (64,)))
    opt = _opt(list(one))
    lone, ltwo = _opt(_params(0, ((16, 128),))), _opt(_params(1, ((8, 128), (64,))))
    for s in range(3):
        for params, ref in ((one, lone), (two, ltwo)):
            opt.param_groups[0]["params"] = params
            _step(opt, params, s)
            _step(ref, ref.param_groups[0]["params"], s)
    for params, ref in ((one, lone), (two, ltwo)):
        _same(params, opt, ref.param_groups[0]["params"], ref)


def test_tensors_at_different_steps_each_take_their_own():
    """A parameter without a gradient for one step lags behind the others of its group
    from then on: each one is bias-corrected at its own step, as separate optimizers do."""
    pa = _params()
    a = _opt(pa)
    alone = [_params()[i:i + 1] for i in range(3)]
    refs = [_opt(ps) for ps in alone]
    for s in range(4):
        skip = (2,) if s == 1 else ()
        _step(a, pa, s, skip)
        for i, (ps, ref) in enumerate(zip(alone, refs)):
            if i not in skip:
                _step(ref, ps, s)
    assert [float(a.state[p]["step"]) for p in pa] == [4.0, 4.0, 3.0]
    for ps, ref, p in zip(alone, refs, pa):
        _same([p], a, ps, ref)


@pytest.mark.parametrize("change", ["bf16", "strided"])
def test_gradients_of_another_kind_than_prepared_are_stepped_as_such(change):
    pa = _params()
    a = _opt(pa)
    for s in range(2):
        _step(a, pa, s)
    pb, b = _twin(pa, a)
    for params, opt in ((pa, a), (pb, b)):
        for p in params:
            g = _grad(p, 2)
            if change == "bf16":
                p.grad = None
                p.grad_dtype = torch.bfloat16
                p.grad = g.bfloat16()
            else:  # the same values, column-major
                p.grad = g.t().contiguous().t() if p.dim() == 2 else g
        opt.step()
    _same(pa, a, pb, b)


def test_group_options_changed_between_steps_take_effect():
    pa = _params()
    a = _opt(pa)
    for s in range(2):
        _step(a, pa, s)
    a.param_groups[0]["dynamic_range_expansion"] = False
    pb, b = _twin(pa, a)
    _step(a, pa, 2)
    _step(b, pb, 2)
    _same(pa, a, pb, b)


class _NoLaunch:
    def __init__(self):
        self.isa = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.isa.append(kwargs["ISA"])


def _coat_calls_in_steady_step(n: int, monkeypatch) -> int:
    """Python functions of coat_ds entered by the third step of `n` tensors, kernel stubbed."""
    monkeypatch.setattr(adamw, "_adamw_kernel", _NoLaunch())
    params = [torch.nn.Parameter(torch.randn(8, 128, device=DEV)) for _ in range(n)] + \
        [torch.nn.Parameter(torch.randn(8, device=DEV))]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = _opt(params)
    opt.step()
    opt.step()
    calls = []
    sys.setprofile(lambda frame, event, arg: calls.append(1) if event == "call" and frame.f_code.co_filename.startswith(
        COAT_DIR) else None)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    return len(calls)


def test_steady_step_runs_no_python_per_tensor(monkeypatch):
    """The host cost that made the 219-tensor step host-bound: a steady step runs the same
    coat_ds Python for 3 tensors as for 30 (per-tensor work stays in C-level passes)."""
    assert _coat_calls_in_steady_step(2, monkeypatch) == _coat_calls_in_steady_step(29, monkeypatch)


def test_fp8_conversions_set_after_the_step_was_prepared_reach_the_next_launch(monkeypatch):
    """set_fp8_conversions promises every kernel launched from then on."""
    launches = _NoLaunch()
    monkeypatch.setattr(adamw, "_adamw_kernel", launches)
    monkeypatch.setattr(fp8, "_ISA", {})
    monkeypatch.setattr(fp8, "select_isa", lambda cap, hip, force_portable=False:
                        fp8.ISA_NVIDIA if force_portable else fp8.ISA_GENERIC)
    params = _params(shapes=((8, 128),))
    for p in params:
        p.grad = torch.randn_like(p)
    opt = _opt(params)
    try:
        opt.step()
        opt.step()
        set_fp8_conversions("portable")
        opt.step()
    finally:
        set_fp8_conversions(None)
    assert launches.isa == [fp8.ISA_GENERIC, fp8.ISA_GENERIC, fp8.ISA_NVIDIA]
