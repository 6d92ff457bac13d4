"""What a saved tensor is stored as: the one decision both the eager hooks and the compiled
graphs make, from facts each path reads in its own way (tensor attributes eagerly, the
forward and backward graphs under torch.compile).

Four outcomes:
* SKIP: alive anyway (a weight, a buffer, a tensor the caller holds): a copy only adds
  memory. Not counted as activation bytes.
* KEEP: stored exactly as it is, counted: tensors whose FP8 error would steer whole rows of
  the gradient or be amplified (statistics, tensors no gradient flows through such as rope
  tables, fused attention's output and, unless configured otherwise, its q, k and v,
  low-precision copies of weights), and tensors where FP8 saves nothing (integers, tiny
  tensors, overlapping views).
* PER_TENSOR: one scale per tensor (linear-layer inputs, what FP8 GEMMs consume).
* PER_GROUP: one scale per 1 x G group along the stride-1 dim (everything else).

Non-finite values are no reason to keep a tensor: the codecs pass +-inf and NaN through
exactly and take scales from the finite values only."""
from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..config import ActivationConfig

__all__ = ["SKIP", "KEEP", "PER_TENSOR", "PER_GROUP", "FLOATS", "Policy"]

SKIP = "skip"
KEEP = "keep"
PER_TENSOR = "per_tensor"
PER_GROUP = "per_group"
FLOATS = frozenset((torch.float32, torch.bfloat16, torch.float16))  # the dtypes we ever quantize


class Policy:
    """`decide(...)` for one configuration. Called once per saved tensor on the eager hot
    path, so it is a few comparisons on arguments the caller already has.

    `decide` is `screen(...)`, on the facts every saved tensor has at hand, then, for a
    tensor it leaves open, `candidate(...)` on the rest. The eager hooks call the two halves
    themselves, reading the costlier facts (memory order, the linear-input and weight-copy
    tables) only for the tensors the screen leaves open."""

    __slots__ = ("min_numel", "linear_kind", "exact_attention_inputs")

    def __init__(self, config: ActivationConfig):
        self.min_numel = max(1, config.min_numel)
        self.linear_kind = PER_TENSOR if config.per_tensor_linear_inputs else PER_GROUP
        self.exact_attention_inputs = not config.compress_attention_inputs

    def screen(self, dtype: torch.dtype, numel, grad_flows: bool, alive_anyway: bool) -> str | None:
        """SKIP or KEEP where these facts settle it whatever the rest are, else None."""
        if alive_anyway:
            return SKIP
        if not grad_flows or dtype not in FLOATS:
            return KEEP
        # Eagerly a plain bool; under dynamic shapes a symbolic one, true only if provable,
        # so that deciding never adds a guard (an unknown size is compressed).
        small = numel < self.min_numel
        if small if type(small) is bool else statically_known_true(small):
            return KEEP
        return None

    def decide(self, dtype: torch.dtype, numel, row_len, dense_order: bool, grad_flows: bool,
               alive_anyway: bool, weight_copy: bool, linear_input: bool, attention_output: bool,
               attention_input: bool = False) -> str:
        """The storage of one saved tensor.

        dtype, numel: the tensor's; numel may be symbolic.
        row_len: elements along its stride-1 dim (symbolic or not); 1 means one value per row.
        dense_order: some order of its dims makes it a dense or gapped block (False: it
            overlaps itself, an expanded view whose elements outnumber its storage's).
        grad_flows: a gradient flows through it (False: a statistic such as logsumexp, or a
            value computed only from inputs that need no gradient, such as rope tables).
        alive_anyway: it outlives the region whatever we do (weights, buffers, caller's data).
        weight_copy: a dtype conversion of a weight (autocast's BF16 copy of an FP32 weight).
        linear_input: it is the input of a linear layer (eager path only).
        attention_output: it is (a view of) the output O of a fused attention op (SDPA's
            flash, efficient, cuDNN or CPU kernels, flex attention), whose backward computes
            rowsum(dO * O) and subtracts it from every score gradient of that row: an FP8
            error there shifts the whole row, as an error in the logsumexp would.
        attention_input: it is (a view or cast of) q, k or v of such an op. Its backward
            recomputes the scores from q and k against the forward's exact logsumexp, so
            their FP8 error reaches every probability of the row; kept unless
            config.compress_attention_inputs. Compiled graphs know it when they decide;
            eagerly the op saves its inputs before it runs, so the hooks decide without it
            and switch the FP8 copies back to exact when the op saves its output
            (`exact_attention_inputs`; hooks.SavedTensorCompressor._keep_attention_inputs)."""
        kind = self.screen(dtype, numel, grad_flows, alive_anyway)
        if kind is not None:
            return kind
        return self.candidate(row_len, dense_order, weight_copy, linear_input, attention_output, attention_input)

    def candidate(self, row_len, dense_order: bool, weight_copy: bool, linear_input: bool,
                  attention_output: bool, attention_input: bool = False) -> str:
        """The storage of a tensor that `screen` left open (facts as in `decide`)."""
        if weight_copy or attention_output or not dense_order or (attention_input and self.exact_attention_inputs):
            return KEEP
        one = row_len == 1
        if one if type(one) is bool else statically_known_true(one):
            return KEEP
        return self.linear_kind if linear_input else PER_GROUP
