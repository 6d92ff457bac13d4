"""The pure-torch twins of the Triton kernels, by name: the CPU path and the tests' oracle.
Each is defined in its op's file beside its kernel; what several share, in fp8_torch.py."""
from .cast_fp8 import cast_fp8
from .cross_entropy import cross_entropy_rows
from .fp8_linear import linear_dequantize, linear_finite_absmax, linear_quantize, linear_scale_exponent
from .fp8_torch import decode_fp8, encode_fp8, exponent_from_bits, pow2, scale_exponent
from .group_codec import dequantize_groups, quantize_groups
from .host import adamw_step
from .rms_norm import rms_norm_backward, rms_norm_forward
from .swiglu import swiglu_backward, swiglu_forward

__all__ = ["encode_fp8", "decode_fp8", "cast_fp8", "scale_exponent", "exponent_from_bits", "pow2", "quantize_groups",
           "dequantize_groups", "adamw_step", "linear_scale_exponent", "linear_finite_absmax", "linear_quantize",
           "linear_dequantize", "rms_norm_forward", "rms_norm_backward", "swiglu_forward", "swiglu_backward",
           "cross_entropy_rows"]
