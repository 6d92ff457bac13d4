"""CoatAdamW as a torch.optim.Optimizer: validation, tracking AdamW, checkpoints, memory."""
import copy
import io

import pytest
import torch

from coat_ds import CoatAdamW


def _mlp(seed=0, dtype=torch.float32, device="cpu"):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 10)).to(device, dtype)


def _data(device="cpu", n=512):
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 64, generator=g).to(device), torch.randint(0, 10, (n,), generator=g).to(device)


def _train(model, opt, steps, device="cpu", dtype=torch.float32):
    x, y = _data(device)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _flat(model):
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("kwargs,match", [
    (dict(lr=-1e-3), "lr"),
    (dict(betas=(1.0, 0.999)), "betas"),
    (dict(betas=(0.9,)), "betas"),
    (dict(eps=-1.0), "eps"),
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(first_moment_format="e3m4"), "e3m4"),
    (dict(second_moment_format="int8"), "int8"),
    (dict(group_size=100), "group_size"),
    (dict(group_size=0), "group_size"),
    (dict(min_quant_numel=-1), "min_quant_numel"),
    (dict(nonfinite="ignore"), "nonfinite"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_arguments_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CoatAdamW(_mlp().parameters(), **kwargs)


def test_bad_param_group_option_raises():
    m = _mlp()
    with pytest.raises(ValueError, match="group_size"):
        CoatAdamW([{"params": m[0].parameters(), "group_size": 96}, {"params": m[2].parameters()}])


def test_sparse_gradient_raises():
    emb = torch.nn.Embedding(100, 64, sparse=True)
    opt = CoatAdamW(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()


def test_tracks_torch_adamw_over_150_steps():
    """FP8 moments with DRE stay close to FP32 AdamW: the relative parameter deviation is
    bounded by 5% (measured 2.4%; per-group absmax FP8 without DRE drifts to ~45% on this
    kind of model, see DESIGN.md) and the loss curves agree."""
    ref, coat = _mlp(), _mlp()
    init = _flat(ref)
    l_ref = _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.01), 150)
    l_coat = _train(coat, CoatAdamW(coat.parameters(), lr=1e-3, weight_decay=0.01), 150)
    dev = ((_flat(ref) - _flat(coat)).norm() / (_flat(ref) - init).norm()).item()
    assert dev < 0.15, dev
    assert ((_flat(ref) - _flat(coat)).norm() / _flat(ref).norm()).item() < 0.05
    assert l_coat[-1] < 0.1 * l_coat[0]
    for a, b in zip(l_ref[::10], l_coat[::10]):
        assert abs(a - b) <= 0.05 * a + 0.01, (a, b)


def test_dre_beats_plain_fp8_in_training():
    ref, dre, plain = _mlp(), _mlp(), _mlp()
    _train(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), 100)
    _train(dre, CoatAdamW(dre.parameters(), lr=1e-3), 100)
    _train(plain, CoatAdamW(plain.parameters(), lr=1e-3, dynamic_range_expansion=False), 100)
    err = lambda m: ((_flat(ref) - _flat(m)).norm() / _flat(ref).norm()).item()  # noqa: E731
    assert err(dre) < 0.5 * err(plain), (err(dre), err(plain))


def test_state_dict_round_trip_resumes_bitwise():
    a = _mlp()
    opt_a = CoatAdamW(a.parameters(), lr=1e-3)
    _train(a, opt_a, 5)
    buf = io.BytesIO()
    torch.save({"model": a.state_dict(), "optim": opt_a.state_dict()}, buf)
    losses_a = _train(a, opt_a, 5)

    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    b = _mlp(seed=123)
    b.load_state_dict(ckpt["model"])
    opt_b = CoatAdamW(b.parameters(), lr=1e-3)
    opt_b.load_state_dict(ckpt["optim"])
    st = opt_b.state[b[0].weight]
    assert st["exp_avg_codes"].dtype == torch.uint8 and st["exp_avg_sexp"].dtype == torch.int8
    losses_b = _train(b, opt_b, 5)
    assert losses_a == losses_b
    assert torch.equal(_flat(a), _flat(b))


def test_small_tensors_keep_fp32_moments_and_bytes_per_param():
    m = torch.nn.Linear(4096, 1024)  # weight quantized, bias (1024 < 4096) FP32
    opt = CoatAdamW(m.parameters())
    m(torch.randn(2, 4096)).sum().backward()
    opt.step()
    assert opt.state[m.weight]["exp_avg_codes"].shape == m.weight.shape
    assert opt.state[m.bias]["exp_avg"].dtype == torch.float32
    rep = opt.state_bytes()
    w = m.weight.numel()
    # Every parameter also counts its skipped steps per group (int32).
    fp8_bytes = rep["state_bytes"] - 8 * m.bias.numel() - 4 * m.bias.numel() // 128
    assert fp8_bytes / w == pytest.approx(2 + 16 / 128)  # 2.125 bytes/param
    assert rep["fp32_adamw_bytes"] == 8 * (w + m.bias.numel())


def test_fp32_conversion_round_trip_and_interop_with_torch_adamw():
    a = _mlp()
    opt = CoatAdamW(a.parameters(), lr=1e-3)
    _train(a, opt, 10)
    fp32 = opt.fp32_state_dict()
    w = a[2].weight
    pid = next(i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if p is w)
    assert fp32["state"][pid]["exp_avg"].dtype == torch.float32
    # torch.optim.AdamW accepts it and keeps training.
    t = torch.optim.AdamW(a.parameters(), lr=1e-3)
    t.load_state_dict(copy.deepcopy(fp32))  # torch keeps (and then bumps) our step tensors
    _train(a, t, 2)
    # Back into CoatAdamW: requantizing dequantized moments reproduces them closely.
    opt2 = CoatAdamW(a.parameters(), lr=1e-3)
    opt2.load_fp32_state_dict(fp32)
    again = opt2.fp32_state_dict()["state"][pid]
    for k in ("exp_avg", "exp_avg_sq"):
        ref = fp32["state"][pid][k]
        rel = ((again[k] - ref).abs() / ref.abs().clamp_min(1e-30))[ref != 0]
        assert rel.max().item() < 0.2 and rel.mean().item() < 0.02
    assert again["step"].item() == 10


def test_nonfinite_skip_and_raise():
    m = torch.nn.Linear(256, 64, bias=False)
    opt = CoatAdamW(m.parameters(), lr=1e-2)
    before = m.weight.detach().clone()
    m.weight.grad = torch.randn_like(m.weight)
    m.weight.grad[3, 200] = float("nan")
    opt.step()
    assert opt.nonfinite_groups() == 1
    assert torch.equal(m.weight[3, 128:], before[3, 128:])
    assert not torch.equal(m.weight[3, :128], before[3, :128])
    assert torch.isfinite(opt.state[m.weight]["exp_avg_center"]).all()

    raising = CoatAdamW(m.parameters(), lr=1e-2, nonfinite="raise")
    m.weight.grad[0, 0] = float("inf")
    with pytest.raises(FloatingPointError, match="non-finite"):
        raising.step()


def test_triton_backend_matches_torch_backend_through_interpreter():
    """The whole optimizer through the Triton kernels (interpreted on CPU) follows the torch
    reference backend over several steps."""
    a, b = _mlp(), _mlp()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    a, b = a.to(dev), b.to(dev)
    _train(a, CoatAdamW(a.parameters(), lr=1e-3, backend="triton"), 8, device=dev)
    _train(b, CoatAdamW(b.parameters(), lr=1e-3, backend="torch"), 8, device=dev)
    assert ((_flat(a) - _flat(b)).norm() / _flat(b).norm()).item() < 1e-3


@pytest.mark.gpu
def test_state_moves_across_devices():
    a = _mlp(device="cuda")
    opt = CoatAdamW(a.parameters(), lr=1e-3)
    _train(a, opt, 3, device="cuda")
    sd = opt.state_dict()
    b = _mlp().to("cpu")
    b.load_state_dict({k: v.cpu() for k, v in a.state_dict().items()})
    opt_b = CoatAdamW(b.parameters(), lr=1e-3)
    opt_b.load_state_dict(sd)
    st = opt_b.state[b[0].weight]
    assert st["exp_avg_codes"].device.type == "cpu" and st["exp_avg_codes"].dtype == torch.uint8
    la = _train(a, opt, 3, device="cuda")
    lb = _train(b, opt_b, 3)
    assert abs(la[-1] - lb[-1]) < 1e-3 * abs(la[-1]) + 1e-5
