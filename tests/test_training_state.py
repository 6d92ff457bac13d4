"""Training-state bytes read from the live tensors (coat_ds.memory.training_state) against the
tensors' own sizes, and train.py's MFU formula on a known shape."""
from __future__ import annotations

import pytest
import torch

from coat_ds.memory.training_state import gradient_bytes, model_numel, training_state_bytes
from coat_ds.models.llama import Llama, ModelConfig, model_config
from coat_ds.optim import CoatAdamW
from coat_ds.train.mfu import flops_per_token, mfu, peak_of

CFG = ModelConfig(dim=64, n_layers=2, n_heads=4, max_seq_len=16)


def _step(model, opt) -> int:
    """One step; returns the gradient bytes read between backward and step()."""
    idx = torch.randint(0, CFG.vocab_size, (2, 17))
    model(idx[:, :-1], idx[:, 1:]).backward()
    grads = gradient_bytes(model, opt)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grads


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("mode", ["step", "in_backward_clipped", "in_backward"])
def test_fp32_model_counts_its_parameters_state_and_gradients(mode):
    torch.manual_seed(0)
    model = Llama(CFG)
    n = sum(p.numel() for p in model.parameters())
    kw = {"step": {}, "in_backward": dict(step_in_backward=True),
          "in_backward_clipped": dict(step_in_backward=True, max_grad_norm=1.0)}[mode]
    opt = CoatAdamW(model.parameters(), lr=1e-3, min_quant_numel=1024, **kw)
    grads = _step(model, opt)
    state = training_state_bytes(model, opt, grads)
    moments = _nbytes(t for s in opt.state.values() for k, t in s.items() if k != "step")
    assert model_numel(model) == n == CFG.num_params()
    # After backward: FP32 gradients; stepping in backward with clipping, the BF16 copies held
    # for step() (2 bytes each); without clipping, every gradient stepped and freed.
    assert state.gradients == {"step": 4 * n, "in_backward_clipped": 2 * n, "in_backward": 0}[mode]
    assert (state.master, state.optimizer, state.compute) == (4 * n, moments, 0)
    assert moments == opt.state_bytes()["state_bytes"] and 2 * n < moments < 2.5 * n
    per = state.per_param(n)
    assert per["master"] == 4.0 and per["total"] == pytest.approx(state.total / n)


def test_bf16_compute_copies_beside_fp32_masters():
    """As DeepSpeed's bf16 mode: the model computes in BF16, the optimizer steps FP32 copies."""
    torch.manual_seed(0)
    model = Llama(CFG).to(torch.bfloat16)
    masters = [p.detach().float().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-3)
    idx = torch.randint(0, CFG.vocab_size, (2, 17))
    model(idx[:, :-1], idx[:, 1:]).backward()
    for m, p in zip(masters, model.parameters()):
        m.grad = p.grad.float()
    grads = gradient_bytes(model, opt)
    opt.step()
    n = CFG.num_params()
    state = training_state_bytes(model, opt, grads)
    assert state.as_dict() == {"master": 4 * n, "optimizer": 8 * n, "gradients": 2 * n + 4 * n, "compute": 2 * n}


def test_mfu_formula_on_llama2_7b():
    cfg = model_config("7b", vocab_size=32000)
    # 6 x (6,738,415,616 - 32000 x 4096 embedding) + 12 x 32 layers x 4096 x 4096 tokens
    assert flops_per_token(cfg, 4096) == 6 * 6_607_343_616 + 6_442_450_944 == 46_086_512_640
    assert mfu(3000.0, cfg, 4096, 989e12) == pytest.approx(3000 * 46_086_512_640 / 989e12)
    assert peak_of("NVIDIA H100 80GB HBM3") == peak_of("NVIDIA H200") == 989e12
    assert peak_of("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_of("NVIDIA H100 PCIe") is None and peak_of("NVIDIA H200 NVL") is None and peak_of("cpu") is None
