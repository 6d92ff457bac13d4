"""FP8 linear layers: FP8 GEMMs forward and backward, the input saved once in FP8; RMSNorms
and SwiGLU activations fused eagerly, handing their output's max to the FP8 layers reading it."""
from .convert import convert_to_fp8_linear
from .layer import Fp8Linear, fp8_gemm_available
from .norm import fuse_rms_norms
from .swiglu import fuse_swiglu

__all__ = ["convert_to_fp8_linear", "Fp8Linear", "fp8_gemm_available", "fuse_rms_norms", "fuse_swiglu"]
