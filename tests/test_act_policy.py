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
           weight_copy=False, linear_input=False, attention_output=False)


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
    ({"attention_output": True}, KEEP),  # SDPA's O: its backward's rowsum(dO * O) steers rows
    ({"attention_output": True, "linear_input": True}, KEEP),  # o_proj's input, where it is O's memory
    ({"attention_output": True, "alive_anyway": True}, SKIP),
    ({"attention_input": True}, KEEP),  # q, k, v: the backward recomputes every score from them
    ({"attention_input": True, "alive_anyway": True}, SKIP),
    ({"attention_input": True, "grad_flows": False}, KEEP),
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
    compress_qkv = Policy(ActivationConfig(compress_attention_inputs=True))
    assert compress_qkv.decide(**{**ACT, "attention_input": True}) == PER_GROUP
    assert compress_qkv.decide(**{**ACT, "attention_input": True, "dense_order": False}) == KEEP


def test_symbolic_sizes_are_compressed_unless_known_small():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(4096, source=ConstantSource("n")), hint=4096)
    policy = Policy(ActivationConfig())
    assert policy.decide(**{**ACT, "numel": n, "row_len": n}) == PER_GROUP
    assert not env.guards  # deciding added no guard on the symbolic size


def test_decide_is_screen_then_candidate():
    """The eager hooks call the two halves themselves: together they are `decide`, and
    where `screen` settles a tensor no other fact changes the outcome."""
    policy = Policy(ActivationConfig())
    others = [dict(row_len=r, dense_order=d, weight_copy=w, linear_input=li, attention_output=a, attention_input=ai)
              for r in (1, 64) for d in (False, True) for w in (False, True) for li in (False, True)
              for a in (False, True) for ai in (False, True)]
    settled = 0
    for dtype in (torch.bfloat16, torch.float32, torch.int64):
        for numel in (1023, 1024):
            for grad_flows in (False, True):
                for alive in (False, True):
                    kind = policy.screen(dtype, numel, grad_flows, alive)
                    for o in others:
                        got = policy.decide(dtype=dtype, numel=numel, grad_flows=grad_flows, alive_anyway=alive, **o)
                        assert got == (kind if kind is not None else policy.candidate(**o))
                    settled += kind is not None
    assert settled == 22  # all but the float, large, gradient-carrying, not-alive ones (2 dtypes)


def test_eager_and_compiled_paths_ask_the_policy(monkeypatch):
    asked, screened, candidates = [], [], []
    decide, screen, candidate = Policy.decide, Policy.screen, Policy.candidate
    signature = inspect.signature(decide)

    def spy(self, *args, **kwargs):
        asked.append(signature.bind(self, *args, **kwargs).arguments)
        return decide(self, *args, **kwargs)

    def screen_spy(self, *args):
        screened.append(args)
        return screen(self, *args)

    def candidate_spy(self, *args):
        candidates.append(args)
        return candidate(self, *args)

    monkeypatch.setattr(policy_module.Policy, "decide", spy)
    monkeypatch.setattr(policy_module.Policy, "screen", screen_spy)
    monkeypatch.setattr(policy_module.Policy, "candidate", candidate_spy)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))
    x = torch.randn(32, 64, requires_grad=True)
    handle = coat_ds.compress_activations(model, config=ActivationConfig(backend="torch", min_numel=256))
    try:
        model(x).sum().backward()
        # The eager hooks screen every saved tensor but the weights' views (x: skipped, as
        # the caller's input), and ask the second half about the two activations left open.
        assert len(screened) >= 3 and any(a[3] for a in screened)
        assert len(candidates) >= 2 and any(a[3] for a in candidates)  # linear_input
        screened.clear()
        candidates.clear()
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


def test_screened_tensors_skip_the_costlier_facts(monkeypatch):
    # Host cost: a tensor the screen settles (the caller's input, a tiny or integer tensor,
    # a statistic) is not walked for its memory order, linear-input entry or weight copy.
    from coat_ds.activation import hooks

    walked, asked = [], []
    memory_order, candidate = hooks.memory_order, Policy.candidate
    monkeypatch.setattr(hooks, "memory_order", lambda t: walked.append(t.shape) or memory_order(t))
    monkeypatch.setattr(policy_module.Policy, "candidate", lambda self, *a: asked.append(a) or candidate(self, *a))

    class Mixed(torch.nn.Module):
        def forward(self, x, idx):
            h = x * 2.0
            small = h[:2, :8] * 3.0  # below min_numel
            stat = torch.logsumexp(h, dim=-1, keepdim=True)  # one value per row: decided, kept
            picked = torch.gather(h, 1, idx)  # saves the int64 index: screened
            return (h * h).sum() + (small * small).sum() + stat.sum() + picked.sum()

    m = Mixed()
    handle = coat_ds.compress_activations(m, config=ActivationConfig(backend="torch", min_numel=256))
    x = torch.randn(32, 64, requires_grad=True)
    m(x, torch.randint(0, 64, (32, 4))).backward()
    handle.remove()
    assert len(walked) == len(asked) >= 1
    assert all(s.numel() >= 256 for s in walked)
