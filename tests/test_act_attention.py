"""Fused attention's output O is stored exactly, eagerly and compiled, for every SDPA kernel,
and so are its q, k and v unless `compress_attention_inputs` (their compiled checks are in
test_act_compile.py).

Their backward computes rowsum(dO * O) and subtracts it from every score gradient of the
row, as it uses the logsumexp: an FP8 O shifts whole rows of the score gradient. On the
Hugging Face models below the q/k projections' gradients fell to 18-22 dB with O in FP8
and are 24.7-27 dB with it exact. It recomputes the scores from q and k against the
forward's logsumexp: eagerly SDPA saves them before it runs, and the hooks switch their
FP8 copies back to exact when it saves O.

The GPU kernels (flash, efficient, cuDNN, the ops behind them) cannot run on CPU: here each
gets a CPU kernel of its own for the test (torch.library), so that autograd builds its real
backward node and AOTAutograd its real graph, and the hooks' decision is checked on them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map

import coat_ds
from coat_ds import ActivationConfig
from helpers import spy_packs, sqnr_db, stored_as_is
from test_act_compile import _graph_saved

CFG = ActivationConfig(backend="torch", min_numel=256)

# Measured, min over the q/k projections' weights and q's bias: BERT 18.3 (eager) with O
# in FP8, 26.3 / 26.0 (eager / compiled) exact; Qwen2 21.9 with O in FP8, 24.7 / 27.8 exact.
ATTN_GRAD_SQNR_DB = 23.5


def _hf(name: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if name == "bert":
        config = transformers.BertConfig(
            vocab_size=128, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
            max_position_embeddings=128, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
            attn_implementation="sdpa")
        # Long bidirectional rows: BERT's q/k gradients are the most sensitive to O.
        return transformers.BertForMaskedLM(config), (1, 128)
    config = transformers.Qwen2Config(
        vocab_size=128, hidden_size=128, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, attn_implementation="sdpa")
    return transformers.Qwen2ForCausalLM(config), (4, 32)


def _hf_grads(model, ids, call=None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (model if call is None else call)(input_ids=ids, labels=ids).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _saved_inputs(seen, nodes) -> list:
    """The (tensor, stored) pairs of `seen` (helpers.spy_packs) whose tensor is an input of
    one of the autograd `nodes`: the q, k and v an attention op saved."""
    inputs = {n for node in nodes for n, _ in node.next_functions}
    return [(t, out) for t, out in seen if t.grad_fn in inputs]


def _recording_sdpa(monkeypatch) -> list[torch.Tensor]:
    """Every output of F.scaled_dot_product_attention from now on (Hugging Face calls it
    through the module attribute)."""
    outputs, sdpa = [], F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        out = sdpa(*args, **kwargs)
        outputs.append(out)
        return out

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return outputs


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", ["bert", "qwen2"])
def test_hf_attention_gradients_with_exact_attention_output(name, compiled):
    model, shape = _hf(name)
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(1))
    want = _hf_grads(model, ids)
    handle = coat_ds.compress_activations(model, config=CFG)
    torch._dynamo.reset()
    try:
        got = _hf_grads(model, ids, torch.compile(model, backend="aot_eager") if compiled else None)
    finally:
        handle.remove()
        torch._dynamo.reset()
    checked = 0
    for n, g in want.items():
        # k's bias gradient is ~0 (softmax ignores a shift of a row's scores; BERT's is 1e-9
        # of q's): noise, whatever is stored.
        if any(s in n for s in ("query", "key", "q_proj", "k_proj")) and not n.endswith(("key.bias", "k_proj.bias")):
            assert sqnr_db(g, got[n]) > ATTN_GRAD_SQNR_DB, (n, sqnr_db(g, got[n]))
            checked += 1
    assert checked == 6


@pytest.mark.parametrize("name", ["bert", "qwen2"])
def test_hf_sdpa_output_is_stored_exactly(name, monkeypatch):
    model, shape = _hf(name)
    ids = torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(1))
    handle = coat_ds.compress_activations(model, config=CFG)
    seen = spy_packs(handle)
    outputs = _recording_sdpa(monkeypatch)
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        handle.remove()
    assert len(outputs) == 2
    for o in outputs:
        stored = [out for t, out in seen if t is o]
        assert stored and all(stored_as_is(o, out) for out in stored)
    assert handle.stats().compressed_tensors >= 10  # the rest is FP8


# The GPU-only ops, called as SDPA's backends call them: (B, H, S, D) for the SDPA ops,
# (B, S, H, D) for the ops behind them. The autograd node each output gets is named by torch.
_GPU_OPS = {
    "_scaled_dot_product_flash_attention": (lambda op, q, k, v: op(q, k, v), "ScaledDotProductFlashAttentionBackward0"),
    "_scaled_dot_product_efficient_attention": (lambda op, q, k, v: op(q, k, v, None, True),
                                                "ScaledDotProductEfficientAttentionBackward0"),
    "_scaled_dot_product_cudnn_attention": (lambda op, q, k, v: op(q, k, v, None, True),
                                            "ScaledDotProductCudnnAttentionBackward0"),
    "_scaled_dot_product_fused_attention_overrideable": (lambda op, q, k, v: op(q, k, v),
                                                         "ScaledDotProductFusedAttentionOverrideableBackward0"),
    "_flash_attention_forward": (
        lambda op, q, k, v: op(*(t.transpose(1, 2) for t in (q, k, v)), None, None, q.shape[2], k.shape[2], 0.0,
                               False, False), "FlashAttentionBackward0"),
    "_efficient_attention_forward": (
        lambda op, q, k, v: op(*(t.transpose(1, 2) for t in (q, k, v)), None, None, None, q.shape[2], k.shape[2],
                               0.0, 0, True), "EfficientAttentionBackward0"),
}


def _known_output(shape, stride) -> torch.Tensor:
    """The O the test kernels return: values FP8 cannot hold exactly, known to the test."""
    out = torch.empty_strided(shape, stride)
    return out.copy_(torch.arange(out.numel(), dtype=torch.float32).reshape(shape).sin())


@pytest.fixture
def cpu_kernel():
    """Registers, for the test, a CPU kernel for a GPU-only attention op: its outputs have
    the shapes, strides and dtypes of the op's meta kernel; O is `_known_output`."""
    lib = torch.library.Library("aten", "IMPL")

    def register(name: str):
        op = getattr(torch.ops.aten, name).default

        def kernel(*args, **kwargs):
            to_meta = lambda a: a.to("meta") if isinstance(a, torch.Tensor) else a  # noqa: E731
            meta = op(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
            return (_known_output(meta[0].shape, meta[0].stride()),
                    *(torch.zeros(m.shape, dtype=m.dtype) if isinstance(m, torch.Tensor) else m for m in meta[1:]))

        lib.impl(name, kernel, "CPU")
        return op

    yield register
    lib._destroy()


class _Attend(nn.Module):
    def __init__(self, attend):
        super().__init__()
        self.proj = nn.Linear(64, 3 * 64)
        self.attend = attend

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 32, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        # Not O itself: a value the graph returns is alive anyway, kept whatever it is.
        return self.attend(q * 1.0, k * 1.0, v * 1.0)[0] * 2.0


@pytest.mark.parametrize("name", sorted(_GPU_OPS))
def test_gpu_attention_ops_keep_their_output(name, cpu_kernel):
    call, node = _GPU_OPS[name]
    if name == "_scaled_dot_product_fused_attention_overrideable" and torch.__version__ < "2.13":
        pytest.skip("torch 2.11 has no CPU kernel for this op's backward, which the compiled half runs")
    op = cpu_kernel(name)
    model = _Attend(lambda q, k, v: call(op, q, k, v))
    x = torch.randn(2, 32, 64, requires_grad=True)
    handle = coat_ds.compress_activations(model, config=CFG)
    seen = spy_packs(handle)
    try:
        model(x)
        # Eagerly: the output its own backward node (named by torch) saves is kept as it is.
        outputs = [(t, out) for t, out in seen if type(t.grad_fn).__name__ == node]
        assert outputs and all(stored_as_is(t, out) for t, out in outputs)
        # And so are q, k and v, which it saved before it ran (as FP8 then, switched back).
        qkv = _saved_inputs(seen, [outputs[0][0].grad_fn])
        assert len(qkv) >= 3 and all(stored_as_is(t, out) for t, out in qkv)
        assert handle.stats().compressed_tensors == 0
        # Compiled: the forward graph saves the op's first output as it is. (Its backward
        # has no CPU kernel and is not run.)
        torch._dynamo.reset()
        held = _graph_saved(torch.compile(model, backend="aot_eager")(x))
    finally:
        handle.remove()
        torch._dynamo.reset()
    o = outputs[0][0]
    want = _known_output(o.shape, o.stride())
    assert any(t.dtype == torch.float32 and t.shape == o.shape and torch.equal(t, want) for t in held)
    assert any(t.dtype == torch.uint8 for t in held)


class _Sdpa(nn.Module):
    """q and k through a product (their own memory), v a gapped view of a fused projection."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(64, 3 * 64), nn.Linear(64, 64)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 32, 3, 4, 16).permute(2, 0, 3, 1, 4).unbind(0)
        o = F.scaled_dot_product_attention(q * 1.0, k * 1.0, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(2, 32, 64))


@pytest.mark.parametrize("compress_qkv", [False, True])
def test_eager_attention_inputs_exact_unless_configured(compress_qkv):
    # SDPA saves q, k and v before it runs; the hooks switch them back to exact when it
    # saves its output. Everything else this model saves is exact anyway (O, the
    # logsumexp; x is a leaf), so by default its gradients are bitwise those without hooks.
    torch.manual_seed(5)
    model, x = _Sdpa(), torch.randn(2, 32, 64, requires_grad=True)
    want = _grads(model, x)
    config = ActivationConfig(backend="torch", min_numel=256, compress_attention_inputs=compress_qkv)
    handle = coat_ds.compress_activations(model, config=config)
    try:
        got = _grads(model, x)
    finally:
        handle.remove()
    stats = handle.stats()
    qkv_bytes = 2 * (2 * 32 * 64 * 4) + 2 * 32 * 3 * 64 * 4  # q and k, then v: its whole fused storage
    o_lse_bytes = 2 * 32 * 64 * 4 + 2 * 4 * 32 * 4
    if compress_qkv:
        assert (stats.compressed_tensors, stats.kept_tensors, stats.kept_bytes) == (3, 2, o_lse_bytes)
        assert min(sqnr_db(want[n], got[n]) for n in want) > 25
        assert any(not torch.equal(want[n], got[n]) for n in want)
    else:
        assert (stats.compressed_tensors, stats.kept_tensors) == (0, 5)
        assert stats.kept_bytes == stats.compressed_bytes == stats.uncompressed_bytes == qkv_bytes + o_lse_bytes
        assert stats.alive_anyway_bytes == 0
        assert all(torch.equal(want[n], got[n]) for n in want)


def _grads(model, x) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    x.grad = None
    model(x).square().sum().backward()
    return {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in model.named_parameters()}}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the SDPA backends' own kernels need CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("backend", ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"])
def test_sdpa_backends_on_cuda(backend, compiled, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from test_act_compile import attention_outputs, holds_attention_output
    from test_act_llama_block import GRAD_SQNR_DB, Block, block_grads, rope_tables

    torch.manual_seed(0)
    # BF16: flash attention needs half precision; no GQA: the efficient kernel has none.
    block = Block(dim=128, heads=4, kv_heads=4, hidden=352).to("cuda", torch.bfloat16)
    torch.manual_seed(4)
    x = torch.randn(2, 128, 128, device="cuda", dtype=torch.bfloat16)
    cos, sin = rope_tables(128, 32, torch.bfloat16, "cuda")
    with sdpa_kernel(getattr(SDPBackend, backend)):
        want = block_grads(block, x, cos, sin)
        (o,) = attention_outputs(monkeypatch, block, x, cos, sin)
        handle = coat_ds.compress_activations(block, config=ActivationConfig())
        torch._dynamo.reset()
        try:
            if compiled:
                fn = torch.compile(block)
                held = _graph_saved(fn(x.clone().requires_grad_(True), cos, sin))
                # Under sdpa_kernel(MATH) torch 2.11's compiled graph still called a fused
                # kernel (seen on an H100): no claim about O there.
                if backend != "MATH":
                    assert any(holds_attention_output(t, o, tol=1e-2) for t in held)
            else:
                fn = block
                seen = spy_packs(handle)
                outputs = attention_outputs(monkeypatch, block, x.clone().requires_grad_(True), cos, sin)
                # The saved O may be another tensor object over the memory SDPA returns. The
                # math backend saves none (its softmax saves the probabilities).
                o = outputs[0]
                stored = [(t, out) for t, out in seen if t.data_ptr() == o.data_ptr() and t.shape == o.shape]
                assert (backend == "MATH") != bool(stored) and all(stored_as_is(t, out) for t, out in stored)
                if stored:  # and the q, k and v its node saved
                    t = stored[0][0] if stored[0][0]._base is None else stored[0][0]._base
                    qkv = _saved_inputs(seen, [t.grad_fn])
                    assert len(qkv) >= 3 and all(stored_as_is(t, out) for t, out in qkv)
                del handle.compressor.pack
            got = {n.removeprefix("_orig_mod."): g for n, g in block_grads(fn, x, cos, sin).items()}
        finally:
            handle.remove()
            torch._dynamo.reset()
    for n in want:
        assert sqnr_db(want[n].float(), got[n].float()) > GRAD_SQNR_DB, n


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2"])
def test_hf_eager_sdpa_inputs_are_stored_exactly(name, monkeypatch):
    # The eager twin of the compiled models' check (test_act_compile_models.py): q, k and v
    # as SDPA saved them, and the q/k projections' gradients closer for it.
    from test_act_compile_models import _hf_model

    model = _hf_model(name)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    want = _hf_grads(model, ids)
    sqnr = {}
    for compress_qkv in (True, False):
        config = ActivationConfig(backend="torch", min_numel=256, compress_attention_inputs=compress_qkv)
        handle = coat_ds.compress_activations(model, config=config)
        seen = spy_packs(handle)
        with monkeypatch.context() as m:
            outputs = _recording_sdpa(m)
            try:
                got = _hf_grads(model, ids)
            finally:
                handle.remove()
        qkv = _saved_inputs(seen, [o.grad_fn for o in outputs])
        assert len(qkv) == 3 * len(outputs) > 0
        assert [stored_as_is(t, out) for t, out in qkv] == [not compress_qkv] * len(qkv)
        sqnr[compress_qkv] = min(sqnr_db(want[n], got[n]) for n in want if n.endswith(("q_proj.weight", "k_proj.weight")))
    # Measured: Llama and Mistral 25.5 -> 29.5 dB, Qwen2 26.1 -> 29.9 dB.
    assert sqnr[False] > sqnr[True] + 2.0, sqnr
