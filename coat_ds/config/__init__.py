"""Configuration dataclasses: frozen, validated on construction, every field documented in the
class docstring's "Attributes:" section (what help() shows)."""
from __future__ import annotations

from dataclasses import dataclass, fields

from ..kernels.fp8 import get_format
from ..kernels.master import MASTER_KINDS

__all__ = ["OptimStateConfig", "AdamWHyperparams", "ActivationConfig", "Fp8LinearConfig", "RecipeConfig", "RECIPES"]

_BACKENDS = ("auto", "triton", "torch")
_NONFINITE = ("skip", "raise")


def _power_of_two(name: str, value: int, lo: int, hi: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or value > hi or value & (value - 1):
        raise ValueError(f"{name} must be a power of two in [{lo}, {hi}], got {value!r}")


def _size_or_none(name: str, value) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")


@dataclass(frozen=True)
class OptimStateConfig:
    """How CoatAdamW stores its moments.

    Attributes:
        first_moment_format: FP8 format of exp_avg: "e4m3" or "e5m2"
        second_moment_format: FP8 format of exp_avg_sq: "e4m3" or "e5m2"
        group_size: elements per quantization group along the last dim (power of two)
        dynamic_range_expansion: per-group x -> sign(x)|x/c|^k before quantizing (DRE)
        min_quant_numel: tensors with fewer elements (whole tensor, not shard) keep FP32 moments
        nonfinite: non-finite grad in a group: "skip" that group (counted) or "raise" after the step
        backend: "triton" kernels, "torch" reference, or "auto": Triton on CUDA, torch elsewhere
        master_weights: "fp32" (the parameter is the FP32 master), "bf16+16" (a BF16 parameter plus a
            16-bit remainder: the exact FP32 master) or "bf16+8" (plus an 8-bit remainder: a 24-bit master)
    """

    first_moment_format: str = "e4m3"
    second_moment_format: str = "e4m3"
    group_size: int = 128
    dynamic_range_expansion: bool = True
    min_quant_numel: int = 4096
    nonfinite: str = "skip"
    backend: str = "auto"
    master_weights: str = "fp32"

    def __post_init__(self):
        for name in ("first_moment_format", "second_moment_format"):
            object.__setattr__(self, name, get_format(getattr(self, name)).name)
        _power_of_two("group_size", self.group_size, 2, 1024)
        if not isinstance(self.dynamic_range_expansion, bool):
            raise ValueError(f"dynamic_range_expansion must be a bool, got {self.dynamic_range_expansion!r}")
        if not isinstance(self.min_quant_numel, int) or self.min_quant_numel < 0:
            raise ValueError(f"min_quant_numel must be an int >= 0, got {self.min_quant_numel!r}")
        if self.nonfinite not in _NONFINITE:
            raise ValueError(f"nonfinite must be one of {_NONFINITE}, got {self.nonfinite!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.master_weights not in MASTER_KINDS:
            raise ValueError(f"master_weights must be one of {tuple(MASTER_KINDS)}, got {self.master_weights!r}")


@dataclass(frozen=True)
class AdamWHyperparams:
    """AdamW's hyper-parameters, checked as torch.optim.AdamW checks them.

    Attributes:
        lr: learning rate, >= 0
        betas: moment decay rates, each in [0, 1)
        eps: added to sqrt(v_hat), >= 0
        weight_decay: decoupled weight decay, >= 0
    """

    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 1e-2

    def __post_init__(self):
        if not _real(self.lr) or self.lr < 0:
            raise ValueError(f"lr must be a float >= 0, got {self.lr!r}")
        betas = tuple(self.betas) if isinstance(self.betas, (tuple, list)) else None
        if betas is None or len(betas) != 2 or not all(_real(b) and 0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must be two floats in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", (float(betas[0]), float(betas[1])))
        if not _real(self.eps) or self.eps < 0:
            raise ValueError(f"eps must be a float >= 0, got {self.eps!r}")
        if not _real(self.weight_decay) or self.weight_decay < 0:
            raise ValueError(f"weight_decay must be a float >= 0, got {self.weight_decay!r}")


def _real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x and abs(x) != float("inf")


@dataclass(frozen=True)
class ActivationConfig:
    """How `compress_activations` stores the tensors autograd saves for backward.

    Attributes:
        linear_input_format: FP8 format of linear-layer inputs (per-tensor scale)
        other_format: FP8 format of every other saved float (per-group scales)
        group_size: elements per scaling group: consecutive elements in memory order (stride-1 dim first)
        per_tensor_linear_inputs: linear inputs get one scale per tensor (False: per group)
        min_numel: saved tensors with fewer elements are kept as they are
        keep_region_leaf_inputs: region inputs without grad_fn (held by the caller) stay uncompressed
        compiled_recompute: under torch.compile, backward recomputes pointwise values it would otherwise save
        compress_attention_inputs: q, k and v saved for a fused attention's backward are compressed too (False:
            kept exact, eagerly and compiled, as they cost more accuracy than any other saved tensor)
        backend: "triton" kernels, "torch" reference, or "auto": Triton on CUDA, torch elsewhere
        eager_min_region_numel: a region called on a first float tensor input of fewer elements keeps
            its eagerly saved tensors exact (compiled graphs still compress; logged once per size);
            None: 2**24 on CUDA, below which the hooks' host work slows the step more than the GPU
            hides (docs/benchmarks.md), 0 elsewhere
    """

    linear_input_format: str = "e4m3"
    other_format: str = "e4m3"
    group_size: int = 16
    per_tensor_linear_inputs: bool = True
    min_numel: int = 1024
    keep_region_leaf_inputs: bool = True
    compiled_recompute: bool = True
    compress_attention_inputs: bool = False
    backend: str = "auto"
    eager_min_region_numel: int | None = None

    def __post_init__(self):
        for name in ("linear_input_format", "other_format"):
            object.__setattr__(self, name, get_format(getattr(self, name)).name)
        _power_of_two("group_size", self.group_size, 2, 1024)
        for name in ("per_tensor_linear_inputs", "keep_region_leaf_inputs", "compiled_recompute",
                     "compress_attention_inputs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.min_numel, int) or isinstance(self.min_numel, bool) or self.min_numel < 0:
            raise ValueError(f"min_numel must be an int >= 0, got {self.min_numel!r}")
        _size_or_none("eager_min_region_numel", self.eager_min_region_numel)
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")


_FP8_GEMM = ("auto", "on", "off")


@dataclass(frozen=True)
class Fp8LinearConfig:
    """How `convert_to_fp8_linear` layers compute: per-tensor FP8 GEMMs, input saved in FP8.

    Attributes:
        input_format: FP8 format of the layer input (the copy backward keeps)
        weight_format: FP8 format of the weight in both GEMMs that read it
        grad_format: FP8 format of the output gradient (input- and weight-gradient GEMMs)
        fp8_gemm: "on"/"off" FP8 GEMMs, or "auto": where the device has them (CUDA 8.9+, CPU)
        fast_accum: forward GEMM accumulates in the tensor cores' fast mode (gradients never do)
        backend: "triton" kernels, "torch" twins, or "auto": Triton on CUDA, twins when compiling or on CPU
        keep_weight_codes: keep forward's FP8 weight for backward (1 byte per weight element held per
            layer) instead of casting it again
        eager_min_macs: an eager call with fewer multiply-adds (tokens x in x out) runs as nn.Linear
            (logged once per shape); None: 2**36 on CUDA, where smaller FP8 layers cost more host
            time than their GEMMs save (docs/benchmarks.md), 0 elsewhere
    """

    input_format: str = "e4m3"
    weight_format: str = "e4m3"
    grad_format: str = "e5m2"
    fp8_gemm: str = "auto"
    fast_accum: bool = True
    backend: str = "auto"
    keep_weight_codes: bool = False
    eager_min_macs: int | None = None

    def __post_init__(self):
        for name in ("input_format", "weight_format", "grad_format"):
            object.__setattr__(self, name, get_format(getattr(self, name)).name)
        # A cuBLASLt FP8 GEMM takes at most one E5M2 operand.
        for a, b in (("input_format", "weight_format"), ("grad_format", "weight_format"),
                     ("grad_format", "input_format")):
            if getattr(self, a) == getattr(self, b) == "e5m2":
                raise ValueError(f"{a} and {b} cannot both be 'e5m2' (they meet in one FP8 GEMM)")
        if self.fp8_gemm not in _FP8_GEMM:
            raise ValueError(f"fp8_gemm must be one of {_FP8_GEMM}, got {self.fp8_gemm!r}")
        for name in ("fast_accum", "keep_weight_codes"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {self.backend!r}")
        _size_or_none("eager_min_macs", self.eager_min_macs)


RECIPES = ("speed", "memory", "max_memory")


@dataclass(frozen=True)
class RecipeConfig:
    """What `coat_ds.prepare` applies to a model; `RecipeConfig.named(recipe, **overrides)`
    gives a named recipe's, with any field overridden.

    Attributes:
        fp8_linear: FP8 GEMMs in the linear layers, the LM head excepted (None: off)
        fuse_norms: RMSNorm modules in one fused kernel each way (an eager speed-up; compiled, their own code runs)
        fuse_swiglu: SwiGLU MLPs' silu(gate) * up in one fused kernel each way (eager, as fuse_norms)
        head_loss: the LM head's loss in chunks of tokens, never the full logits (fuse_lm_head_loss)
        head_loss_chunk_tokens: tokens per chunk of the head loss; None: about 256 MiB of logits
        compress_activations: saved activations kept in FP8 with this config (None: off)
        recompute: every decoder layer recomputed in backward, its input kept until then as FP8 codes
        compile_regions: under a whole-model torch.compile, each decoder layer compiled once on its own,
            one graph for every layer of its class (less to compile before the first step), and the
            code between the layers run eagerly
        step_in_backward: the optimizer options the report suggests include CoatAdamW's step_in_backward
            (FSDP2: each parameter stepped, and its gradient freed, as soon as backward has it)
    """

    fp8_linear: Fp8LinearConfig | None = None
    fuse_norms: bool = False
    fuse_swiglu: bool = False
    head_loss: bool = False
    head_loss_chunk_tokens: int | None = None
    compress_activations: ActivationConfig | None = None
    recompute: bool = False
    compile_regions: bool = False
    step_in_backward: bool = False

    def __post_init__(self):
        for name, cls in (("fp8_linear", Fp8LinearConfig), ("compress_activations", ActivationConfig)):
            value = getattr(self, name)
            if value is True:
                object.__setattr__(self, name, cls())
            elif value is False:
                object.__setattr__(self, name, None)
            elif value is not None and not isinstance(value, cls):
                raise TypeError(f"{name} must be a bool, None or a {cls.__name__}, got {value!r}")
        for name in ("fuse_norms", "fuse_swiglu", "head_loss", "recompute", "compile_regions", "step_in_backward"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        chunk = self.head_loss_chunk_tokens
        if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1):
            raise ValueError(f"head_loss_chunk_tokens must be None or an int >= 1, got {chunk!r}")

    @classmethod
    def named(cls, recipe: str, **overrides) -> "RecipeConfig":
        """The recipe `recipe` ("speed", "memory" or "max_memory"), then `overrides` by field name.

        speed: FP8 linears, fused norms and SwiGLU, the fused head loss, decoder layers compiled as regions.
        memory: speed + FP8 saved activations.
        max_memory: memory + decoder layers recomputed from FP8 inputs + step in backward."""
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(overrides) - set(names))
        if unknown:
            raise TypeError(f"unknown recipe setting(s) {unknown}; valid: {', '.join(names)}")
        values = dict(fp8_linear=Fp8LinearConfig(), fuse_norms=True, fuse_swiglu=True, head_loss=True,
                      compile_regions=True)
        if recipe != "speed":
            values["compress_activations"] = ActivationConfig()
        if recipe == "max_memory":
            values.update(recompute=True, step_in_backward=True)
        return cls(**{**values, **overrides})
