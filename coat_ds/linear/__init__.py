"""FP8 linear layers: FP8 GEMMs forward and backward, the input saved once in FP8."""
from .convert import convert_to_fp8_linear
from .layer import Fp8Linear, fp8_gemm_available

__all__ = ["convert_to_fp8_linear", "Fp8Linear", "fp8_gemm_available"]
