"""`Fp8Linear`: an nn.Linear whose GEMMs run in FP8 and whose saved input is FP8."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from ..config import Fp8LinearConfig
from ..kernels.fp8 import cuda_has_fp8, get_format
from ..kernels.layout import new_weight_guess
from ..kernels.registry import get
from .function import Fp8LinearSpec, fp8_linear, input_max_split

__all__ = ["Fp8Linear", "fp8_gemm_available"]

_GUESS = "fp8_weight_guess"
_SPEC = "_fp8_spec"
logger = logging.getLogger("coat_ds.linear")
# Fp8LinearConfig.eager_min_macs's default on CUDA: an eager FP8 layer costs more host work per
# step than nn.Linear, which its GEMMs save back from about this size on (docs/benchmarks.md,
# "the eager size limits").
CUDA_EAGER_MIN_MACS = 2 ** 36
# (in, out, tokens) already logged as running as nn.Linear. The first is a WARNING, so that it
# shows without logging configured (HF Trainer's and train.py's case); the rest are INFO.
_told: set = set()


def eager_min_macs(config: Fp8LinearConfig, device: torch.device) -> int:
    """The multiply-adds below which an eager call on `device` runs as nn.Linear."""
    limit = config.eager_min_macs
    if limit is None:
        return CUDA_EAGER_MIN_MACS if device.type == "cuda" else 0
    return limit


def _tell_small(in_f: int, out_f: int, tokens: int, limit: int) -> None:
    key = (in_f, out_f, tokens)
    if key not in _told:
        level = logging.INFO if _told else logging.WARNING
        _told.add(key)
        logger.log(level, "Fp8Linear %d x %d at %d tokens: %.3g G multiply-adds < eager_min_macs %.3g G, so it "
                   "runs eagerly as nn.Linear (FP8's host work would outlast what its GEMMs save; compiled, or with "
                   "Fp8LinearConfig(eager_min_macs=0), it runs in FP8)", in_f, out_f, tokens,
                   in_f * out_f * tokens / 1e9, limit / 1e9)


def compute_device(model: nn.Module) -> torch.device:
    """Where `model`'s layers will compute: its first parameter's device; for a model built
    on the meta device (given storage later, where it trains) the current GPU, else the CPU."""
    p = next(model.parameters(), None)
    if p is not None and p.device.type != "meta":
        return p.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def fp8_gemm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs FP8 GEMMs on `device`: CUDA compute capability 8.9+
    (fp8.FP8_CAPABILITY) or CPU."""
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return cuda_has_fp8(device.index if device.index is not None else torch.cuda.current_device())
    return False


def fp8_spec(config: Fp8LinearConfig, device: torch.device, weight_shape: torch.Size,
             compiling: bool) -> Fp8LinearSpec:
    """What a layer of `config` with a weight of `weight_shape` computes with on `device`."""
    fp8_gemm = fp8_gemm_available(device) if config.fp8_gemm == "auto" else config.fp8_gemm == "on"
    kernels = get("fp8_linear", device, config.backend, "Fp8LinearConfig.backend")
    # "auto" compiled: the torch twin, which Inductor fuses into the kernels around it.
    quantize = get("fp8_linear", device, "torch").quantize if compiling and config.backend == "auto" else kernels.quantize
    return Fp8LinearSpec(get_format(config.input_format), get_format(config.weight_format),
                         get_format(config.grad_format), fp8_gemm, config.fast_accum,
                         config.keep_weight_codes and fp8_gemm, (config.input_format, fp8_gemm, config.backend),
                         input_max_split(weight_shape), quantize, kernels.quantize_kept)


class Fp8Linear(nn.Linear):
    """nn.Linear with FP8 compute: same parameters, same state_dict keys.

    Forward quantizes the input and the weight per tensor and runs `torch._scaled_mm`;
    backward runs the input- and weight-gradient GEMMs in FP8 from the output gradient, the
    FP8 input copy saved in forward and the weight quantized again. Output in the autocast
    dtype under autocast, else in the input's dtype. `convert_to_fp8_linear` makes these
    from existing layers in place.

    The buffer `fp8_weight_guess` (not in the state_dict) holds what the Triton kernels
    learned of the weight's exponent last step; it moves with the module. A weight shared by
    two layers has a guess in each.

    Eagerly, a call smaller than `config.eager_min_macs` runs as nn.Linear: on a GPU the
    FP8 path's extra host work is then not paid back by faster GEMMs."""

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

    def _spec(self, device: torch.device) -> Fp8LinearSpec:
        """`fp8_spec` for eager calls on `device`, made once per config and device."""
        cfg = self.fp8_config
        cached = self.__dict__.get(_SPEC)  # absent on a layer converted before it existed
        if cached is None or cached[0] is not cfg or cached[1] != device:
            cached = self.__dict__[_SPEC] = (cfg, device, fp8_spec(cfg, device, self.weight.shape, False))
        return cached[2]

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        cfg = self.fp8_config
        device = input.device
        if torch.compiler.is_compiling():
            spec = fp8_spec(cfg, device, self.weight.shape, True)
        else:
            limit = eager_min_macs(cfg, device)
            if limit:
                tokens = input.numel() // self.in_features
                if tokens * self.in_features * self.out_features < limit:
                    _tell_small(self.in_features, self.out_features, tokens, limit)
                    return F.linear(input, self.weight, self.bias)
            spec = self._spec(device)
        out_dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else input.dtype
        weight = self.weight
        return fp8_linear(input, weight, self.bias, self._weight_guess(weight), out_dtype, spec)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8_config={self.fp8_config}"
