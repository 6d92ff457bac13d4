"""`Fp8Linear`: an nn.Linear whose GEMMs run in FP8 and whose saved input is FP8."""
from __future__ import annotations

import torch
from torch import nn

from ..config import Fp8LinearConfig
from ..kernels.fp8 import cuda_has_fp8
from ..kernels.layout import new_weight_guess
from .function import fp8_linear

__all__ = ["Fp8Linear", "fp8_gemm_available"]

_GUESS = "fp8_weight_guess"


def fp8_gemm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 GEMMs on `device`: CUDA compute capability 8.9+
    (Ada, Hopper and later) or CPU."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return cuda_has_fp8(device.index if device.index is not None else torch.cuda.current_device())
    return False


class Fp8Linear(nn.Linear):
    """nn.Linear with FP8 compute: same parameters, same state_dict keys.

    Forward quantizes the input and the weight per tensor and runs `torch._scaled_mm`;
    backward runs the input- and weight-gradient GEMMs in FP8 from the output gradient, the
    FP8 input copy saved in forward and the weight quantized again. Output in the autocast
    dtype under autocast, else in the input's dtype. `convert_to_fp8_linear` makes these
    from existing layers in place.

    The buffer `fp8_weight_guess` (not in the state_dict) holds what the Triton kernels
    learned of the weight's exponent last step; it moves with the module. A weight shared by
    two layers has a guess in each."""

    fp8_config: Fp8LinearConfig

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 config: Fp8LinearConfig | None = None):
        super().__init__(in_features, out_features, bias, device, dtype)
        self.fp8_config = config if config is not None else Fp8LinearConfig()
        self._weight_guess(self.weight)

    def _weight_guess(self, weight: torch.Tensor) -> torch.Tensor:
        """The exponent-guess state of `weight` (this layer's), on its device: made where
        missing (a layer made before it existed) or elsewhere (a weight moved without
        Module.to, as engines that offload parameters do)."""
        guess = self._buffers.get(_GUESS)
        device = weight.device
        if guess is None or guess.device != device:
            guess = new_weight_guess(device)
            self.register_buffer(_GUESS, guess, persistent=False)
        return guess

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        cfg = self.fp8_config
        dev_type = input.device.type
        if torch.is_autocast_enabled(dev_type):
            out_dtype = torch.get_autocast_dtype(dev_type)
        else:
            out_dtype = input.dtype
        if cfg.fp8_gemm == "auto":
            fp8_gemm = fp8_gemm_available(input.device)
        else:
            fp8_gemm = cfg.fp8_gemm == "on"
        weight = self.weight
        return fp8_linear(input, weight, self.bias, out_dtype, fp8_gemm,
                          (cfg.input_format, cfg.weight_format, cfg.grad_format), cfg.fast_accum, cfg.backend,
                          cfg.keep_weight_codes, self._weight_guess(weight))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_config={self.fp8_config}"
