"""The storage policy on its own: what is skipped, kept exact, per-tensor, per-group; and
that the eager hooks and the compiled graphs both ask it (one decision, not two copies)."""
from __future__ import annotations

import inspect

import pytest
import torch

import coat_ds
from coat_ds import ActivationConfig
from coat_ds.activation import policy as policy_module
from coat_ds.activation.policy import KEEP, PER_GROUP, PER_TENSOR, SKIP, Policy

# An activation that is compressed: every fact at its "compress" value.
ACT = dict(dtype=torch.bfloat16, numel=4096, row_len=64, dense_order=True, grad_flows=True, alive_anyway=False,
           weight_copy=False, linear_input=False)


@pytest.mark.parametrize("change,want", [
    ({}, PER_GROUP),
    ({"linear_input": True}, PER_TENSOR),
    ({"dtype": torch.float32}, PER_GROUP),
    ({"dtype": torch.float16, "linear_input": True}, PER_TENSOR),
    ({"alive_anyway": True}, SKIP),  # weights, buffers, the caller's inputs
    ({"alive_anyway": True, "dtype": torch.int64}, SKIP),
    ({"weight_copy": True}, KEEP),  # autocast's BF16 copy of an FP32 weight
    ({"weight_copy": True, "linear_input": True}, KEEP),
    ({"grad_flows": False}, KEEP),  # statistics, rope tables
    ({"grad_flows": False, "linear_input": True}, KEEP),
    ({"row_len": 1}, KEEP),  # one value per row: a norm's rsqrt
    ({"dense_order": False}, KEEP),  # an expanded view
    ({"dtype": torch.int64}, KEEP),
    ({"dtype": torch.bool}, KEEP),
    ({"dtype": torch.float8_e4m3fn}, KEEP),
    ({"numel": 1023}, KEEP),
    ({"numel": 1024}, PER_GROUP),
])
def test_decisions(change, want):
    assert Policy(ActivationConfig()).decide(**{**ACT, **change}) == want


def test_decisions_follow_the_config():
    assert Policy(ActivationConfig(per_tensor_linear_inputs=False)).decide(**{**ACT, "linear_input": True}) == PER_GROUP
    assert Policy(ActivationConfig(min_numel=16)).decide(**{**ACT, "numel": 16}) == PER_GROUP
    assert Policy(ActivationConfig(min_numel=0)).decide(**{**ACT, "numel": 1}) == PER_GROUP


def test_symbolic_sizes_are_compressed_unless_known_small():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(4096, source=ConstantSource("n")), hint=4096)
    policy = Policy(ActivationConfig())
    assert policy.decide(**{**ACT, "numel": n, "row_len": n}) == PER_GROUP
    assert not env.guards  # deciding added no guard on the symbolic size


def test_eager_and_compiled_paths_ask_the_policy(monkeypatch):
    asked = []
    decide = Policy.decide
    signature = inspect.signature(decide)

    def spy(self, *args, **kwargs):
        asked.append(signature.bind(self, *args, **kwargs).arguments)
        return decide(self, *args, **kwargs)

    monkeypatch.setattr(policy_module.Policy, "decide", spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    x = torch.randn(32, 64, requires_grad=True)
    handle = coat_ds.compress_activations(model, config=ActivationConfig(backend="torch", min_numel=256))
    try:
        model(x).sum().backward()
        assert len(asked) >= 3 and any(f["linear_input"] for f in asked)  # the eager hooks
        asked.clear()
        handle.reset_stats()
        torch._dynamo.reset()
        torch.compile(model, backend="aot_eager")(x).sum().backward()
        # Inside the compiled graph no eager hook saw a tensor: these are the traced pack's.
        st = handle.stats()
        assert st.compressed_tensors == st.kept_tensors == 0 and len(asked) >= 2
        assert not any(f["linear_input"] for f in asked)
    finally:
        handle.remove()
        torch._dynamo.reset()
