"""compress_activations under torch.compile: the FP8 quantization inlined into the compiled
graphs, what those graphs keep as it is, the partitioner's recomputation, FSDP2, dynamic
shapes, and the graph cache."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import coat_ds
from coat_ds import ActivationConfig
from coat_ds.activation import hooks as hooks_module
from coat_ds.activation.hooks import SavedTensorCompressor
from test_act_llama_block import GRAD_SQNR_DB, block_grads, make_block, rope_tables, sqnr_db

CFG = ActivationConfig(backend="torch", min_numel=256)


def _graph_saved(out) -> list[torch.Tensor]:
    """What the compiled functions' backward nodes hold (the graphs' saved values)."""
    saved, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "CompiledFunctionBackward":
            saved += node.saved_tensors
        stack += [f for f, _ in node.next_functions]
    assert saved, "no compiled graph in the autograd graph"
    return saved


def _held(fn, x, cos, sin) -> list[torch.Tensor]:
    """What one forward of `fn` (x requiring grad) leaves saved in its compiled graphs."""
    held = _graph_saved(fn(x.requires_grad_(True), cos, sin))
    x.requires_grad_(False)
    return held


def _assert_grads_close(fn, x, cos, sin, want) -> None:
    got = {n.removeprefix("_orig_mod."): g for n, g in block_grads(fn, x, cos, sin).items()}
    for n in want:
        g = got[n].full_tensor() if hasattr(got[n], "full_tensor") else got[n]  # FSDP2: DTensor
        assert sqnr_db(want[n], g) > GRAD_SQNR_DB, n


def attention_calls(monkeypatch, fn, *args) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(q, k and v, outputs) of F.scaled_dot_product_attention while `fn(*args)` runs eagerly."""
    inputs, outputs, sdpa = [], [], F.scaled_dot_product_attention

    def spy(*a, **k):
        inputs.extend(t.detach() for t in a[:3])
        outputs.append(sdpa(*a, **k))
        return outputs[-1]

    with monkeypatch.context() as m:
        m.setattr(F, "scaled_dot_product_attention", spy)
        fn(*args)
    return inputs, [o.detach() for o in outputs]


def attention_outputs(monkeypatch, fn, *args) -> list[torch.Tensor]:
    """The outputs of F.scaled_dot_product_attention while `fn(*args)` runs eagerly."""
    return attention_calls(monkeypatch, fn, *args)[1]


def holds(t: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> bool:
    """`t`, a graph's saved value, is `want` as it is (to float32's last bits: Inductor's
    q and k may differ from eager's there, far below FP8's 6% step)."""
    return t.dtype == want.dtype and t.shape == want.shape and torch.allclose(t, want, rtol=10 * tol, atol=tol)


def holds_attention_output(t: torch.Tensor, o: torch.Tensor, tol: float = 1e-5) -> bool:
    """`t`, a graph's saved value, is attention's output `o` (B, H, S, D) as it is, or
    reshaped to (B * S, H * D) for o_proj. Inductor's q and k may differ from eager's in the
    last bit: `tol` (float32's default) is far below FP8's step (6%)."""
    if t.dtype != o.dtype or t.numel() != o.numel():
        return False
    b, h, s, d = o.shape
    return any(holds(t, v, tol) for v in (o, o.transpose(1, 2).reshape(b * s, h * d)))


def _float_bytes(tensors, floor: int) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t.is_floating_point() and t.numel() >= floor)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_inlines_fp8_into_the_graphs(backend, monkeypatch):
    block = make_block(torch.float32)
    params = {p.data_ptr() for p in block.parameters()}
    torch.manual_seed(3)
    x = torch.randn(2, 32, 64)
    cos, sin = rope_tables(32, 16, torch.float32)
    want = block_grads(block, x, cos, sin)
    qkv, (o,) = attention_calls(monkeypatch, block, x, cos, sin)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=backend)
    plain = _held(compiled, x, cos, sin)
    handle = coat_ds.compress_activations(block, config=CFG)
    try:
        held = _held(compiled, x, cos, sin)
        _assert_grads_close(compiled, x, cos, sin, want)
        # The quantization runs inside the graph: no Python hook saw a tensor.
        assert handle.stats().compressed_tensors == 0
        # Parameters, the caller's rope tables (no gradient: alive anyway), attention's
        # logsumexp (a statistic), its output (its backward's rowsum(dO * O) steers rows)
        # and its q, k and v (its backward recomputes every score from them) are saved as
        # they are; every other saved float of activation size is now FP8 codes and scales.
        lse = [t for t in held if t.shape == (2, 4, 32)]
        assert len(lse) == 1 and lse[0].dtype == torch.float32
        assert any(holds_attention_output(t, o) for t in held)
        assert all(any(holds(t, v) for t in held) for v in qkv)

        def as_is(t):
            return (t.data_ptr() in params or t.data_ptr() in (cos.data_ptr(), sin.data_ptr()) or t is lse[0]
                    or holds_attention_output(t, o) or any(holds(t, v) for v in qkv))

        kept = [t for t in held if t.is_floating_point() and t.numel() >= 256]
        assert all(as_is(t) for t in kept)
        assert any(t.dtype == torch.uint8 for t in held) and any(t.dtype == torch.int8 for t in held)
        acts = lambda ts: sum(t.numel() * t.element_size() for t in ts  # noqa: E731
                              if t.numel() >= 256 and not as_is(t) and t.shape != (2, 4, 32))
        assert acts(held) < 0.3 * acts(plain)  # float32 -> 1 byte codes + 1 byte per 16 scales
        # Dynamo guards on the hooks in force: paused, the graph recompiles without them.
        handle.enabled = False
        paused = _held(compiled, x, cos, sin)
        assert _float_bytes(paused, 256) == _float_bytes(plain, 256)
    finally:
        handle.remove()
        torch._dynamo.reset()


class _Mlp(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 3 * d), torch.nn.Linear(3 * d, d)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def test_compiled_rows_not_a_multiple_of_the_group_size(device):
    # Rows of 40 and 120: the per-row padded layout read the last group of every row back as
    # zeros under Inductor's CPU backend (15.5 dB here, 46 dB eagerly).
    def grads(compress: bool, compile_: bool):
        torch.manual_seed(0)
        m, x = _Mlp(40).to(device), torch.randn(8, 64, 40, device=device)
        if compile_:
            m.compile()
        handle = coat_ds.compress_activations(m, config=CFG) if compress else None
        try:
            m(x).pow(2).sum().backward()
        finally:
            if handle is not None:
                handle.remove()
            torch._dynamo.reset()
        return torch.cat([p.grad.flatten() for p in m.parameters()])

    want = grads(False, False)
    eager, compiled = sqnr_db(want, grads(True, False)), sqnr_db(want, grads(True, True))
    assert eager > 35 and compiled > 35, (eager, compiled)


class _Exp(torch.nn.Module):
    def forward(self, x):
        return (x.sin() * 3).exp().sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_eager_hooks_and_compiled_graphs_store_the_same_codes(backend, monkeypatch):
    # One codec: the FP8 copy a compiled graph stores of a saved value is the one the eager
    # hooks make of it, codes and exponents alike. Rows of 40 make groups that span rows.
    # Eagerly sin saves x (kept exact here only by keep_region_leaf_inputs) and exp its
    # output; a compiled graph saves either, or recomputes exp from x.
    from coat_ds.activation import packing

    made, init = [], packing.FP8Saved.__init__
    monkeypatch.setattr(packing.FP8Saved, "__init__", lambda self, *a: init(self, *a) or made.append(self))
    m, x = _Exp(), torch.randn(8, 40, requires_grad=True)
    handle = coat_ds.compress_activations(m, config=dataclasses.replace(CFG, keep_region_leaf_inputs=False))
    try:
        m(x)
        compiled = _graph_saved(torch.compile(m, backend=backend)(x))
    finally:
        handle.remove()
        torch._dynamo.reset()
    assert len(made) == 2 and all(s.exps.shape == (20,) for s in made)
    codes = [t for t in compiled if t.dtype == torch.uint8]
    exps = [t for t in compiled if t.dtype == torch.int8]
    assert len(codes) == len(exps) >= 1
    for c, e in zip(codes, exps):
        assert any(torch.equal(c, s.codes) and torch.equal(e, s.exps) for s in made)


@pytest.mark.gpu
def test_torch_compile_on_cuda():
    # float32, so that FP8 is the only rounding between the two runs (the codecs' BF16
    # path on CUDA is checked bitwise above).
    block = make_block(torch.float32, dim=256).cuda()
    torch.manual_seed(5)
    x = torch.randn(4, 128, 256, device="cuda")
    cos, sin = rope_tables(128, 64, torch.float32, "cuda")
    torch._dynamo.reset()
    compiled = torch.compile(block)
    want = {n.removeprefix("_orig_mod."): g for n, g in block_grads(compiled, x, cos, sin).items()}
    handle = coat_ds.compress_activations(block, config=ActivationConfig())
    try:
        held = _held(compiled, x, cos, sin)
        assert sum(t.numel() for t in held if t.dtype == torch.uint8) >= 7 * x.numel()  # q, k, v exact
        _assert_grads_close(compiled, x, cos, sin, want)
    finally:
        handle.remove()
        torch._dynamo.reset()


def test_torch_compile_inlines_where_tracing_is_not_compiling(monkeypatch):
    # torch 2.11 traces the pack on functional tensors with is_compiling() False; the
    # pack must still take its traced path rather than keep the tensor as a subclass.
    monkeypatch.setattr(hooks_module, "_is_compiling", lambda: False)
    test_torch_compile_inlines_fp8_into_the_graphs("aot_eager", monkeypatch)


def test_torch_compile_under_fsdp2(monkeypatch):
    # As train.py --fsdp --compile does: hooks, then each block compiled in place, then
    # fully_shard. FSDP2's hooks stay outside the graph; the graph still saves FP8.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers import free_port

    # Set for this test only: later tests start launchers that read RANK and WORLD_SIZE.
    for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    torch.distributed.init_process_group("gloo")
    try:
        block = make_block(torch.float32)
        x = torch.randn(2, 32, 64)
        cos, sin = rope_tables(32, 16, torch.float32)
        want = block_grads(block, x, cos, sin)
        handle = coat_ds.compress_activations(block, config=CFG)
        torch._dynamo.reset()
        block.compile()
        fully_shard(block, mesh=init_device_mesh("cpu", (1,)))  # CPU and gloo, GPU or not
        held = _held(block, x, cos, sin)
        # 7.5 x.numel() here: 8 and more with q, k and v compressed too (their dims are GQA's).
        assert sum(t.numel() for t in held if t.dtype == torch.uint8) >= 7 * x.numel()
        _assert_grads_close(block, x, cos, sin, want)
        handle.remove()
    finally:
        torch._dynamo.reset()
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def test_torch_compile_dynamic_shapes_are_compressed_too(monkeypatch):
    block = make_block(torch.float32)
    handle = coat_ds.compress_activations(block, config=CFG)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", dynamic=True)
    try:
        for b, s in ((2, 32), (3, 48)):
            x = torch.randn(b, s, 64, requires_grad=True)
            cos, sin = rope_tables(s, 16, torch.float32)
            qkv, (o,) = attention_calls(monkeypatch, block, x, cos, sin)
            held = _graph_saved(compiled(x, cos, sin))
            # Symbolic sizes: every saved activation is still FP8; only weights and attention's
            # output (as it is, or o_proj's input viewing it) and inputs stay float.
            params = {p.data_ptr() for p in block.parameters()} | {cos.data_ptr(), sin.data_ptr()}
            assert any(holds_attention_output(t, o) for t in held)
            assert all(any(holds(t, v) for t in held) for v in qkv)
            assert not [t.shape for t in held if t.is_floating_point() and t.data_ptr() not in params
                        and t.numel() >= b * s * 16 and not holds_attention_output(t, o)
                        and not any(holds(t, v) for v in qkv)]
            assert sum(t.numel() for t in held if t.dtype == torch.uint8) >= 7 * b * s * 64
    finally:
        handle.remove()
        torch._dynamo.reset()


@pytest.mark.parametrize("compress_qkv", [False, True])
def test_compiled_attention_inputs_exact_unless_configured(compress_qkv, monkeypatch):
    # q and k are what attention's backward recomputes every score from, against forward's
    # exact logsumexp: by default the graph keeps them (and v) as they are.
    block = make_block(torch.float32)
    torch.manual_seed(7)
    x = torch.randn(2, 32, 64)
    cos, sin = rope_tables(32, 16, torch.float32)
    qkv, _ = attention_calls(monkeypatch, block, x, cos, sin)
    handle = coat_ds.compress_activations(block, config=dataclasses.replace(CFG, compress_attention_inputs=compress_qkv))
    torch._dynamo.reset()
    try:
        held = _held(torch.compile(block, backend="aot_eager"), x, cos, sin)
    finally:
        handle.remove()
        torch._dynamo.reset()
    assert [any(holds(t, v) for t in held) for v in qkv] == [not compress_qkv] * 3


def test_compiled_graph_cache_is_keyed_by_config():
    # AOTAutograd's cache keys inlined hooks by their graphs' wrapped-call hashes: two
    # configurations (or two versions of our code) must never share a cached graph.
    def key(config):
        gm = SavedTensorCompressor(config).hooks[0]
        return [n.meta.get("user_cache_hash") for n in gm.graph.nodes if n.op == "call_function"]

    assert key(CFG) == key(ActivationConfig(backend="torch", min_numel=256))
    assert key(CFG) != key(ActivationConfig(backend="torch", min_numel=256, group_size=32))
    assert key(CFG) != key(ActivationConfig(backend="torch", min_numel=256, other_format="e5m2"))
    assert key(CFG) != key(dataclasses.replace(CFG, compress_attention_inputs=True))


@pytest.mark.slow
def test_compiled_graphs_keep_statistics_and_recompute_rather_than_save():
    block = make_block(torch.float32)
    torch.manual_seed(6)
    x = torch.randn(4, 128, 64)
    cos, sin = rope_tables(128, 16, torch.float32)
    want = block_grads(block, x, cos, sin)
    before = torch._functorch.config.ban_recompute_materialized_backward
    fp8_bytes = {}
    for recompute in (False, True):
        config = ActivationConfig(backend="torch", min_numel=256, compiled_recompute=recompute)
        handle = coat_ds.compress_activations(block, config=config)
        torch._dynamo.reset()
        compiled = torch.compile(block, backend="aot_eager")
        try:
            held = _held(compiled, x, cos, sin)
            # Both norms' rsqrt (one value per row) and attention's logsumexp (no gradient
            # flows through it) steer whole rows of the gradient: stored as they are.
            assert sum(t.dtype == torch.float32 and t.shape == (4, 128, 1) for t in held) == 2
            assert sum(t.dtype == torch.float32 and t.shape == (4, 4, 128) for t in held) == 1
            fp8_bytes[recompute] = sum(t.numel() for t in held if t.dtype in (torch.uint8, torch.int8))
            _assert_grads_close(compiled, x, cos, sin, want)
        finally:
            handle.remove()
            torch._dynamo.reset()
        # The region sets the partitioner's option only while it runs.
        assert torch._functorch.config.ban_recompute_materialized_backward == before
    # Backward recomputes the norms' outputs and silu(gate) * up from saved values.
    assert fp8_bytes[True] < 0.75 * fp8_bytes[False]
