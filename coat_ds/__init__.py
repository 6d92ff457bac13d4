"""coat_ds: memory-efficient FP8 training (COAT) for DeepSpeed and PyTorch FSDP."""
from .activation import ActivationStats, activation_stats, compress_activations
from .config import ActivationConfig, AdamWHyperparams, Fp8LinearConfig, OptimStateConfig, RecipeConfig
from .integrations import fsdp
from .integrations.fsdp import FsdpConfig, setup_fsdp
from .linear import Fp8Linear, convert_to_fp8_linear, fuse_rms_norms, fuse_swiglu
from .loss import fuse_lm_head_loss
from .optim import CoatAdamW
from .plan import ApplyConfig, Plan, apply_plan, load_plan
from .recipes import PrepareReport, prepare


def register_deepspeed() -> None:
    """`coat_ds.integrations.deepspeed.registry.register_deepspeed`: lets DeepSpeed's own
    `deepspeed.initialize` (and so HF Trainer and Accelerate) build CoatAdamW from
    `"type": "CoatAdamW"` by adding `torch.optim.CoatAdamW` and an entry in DeepSpeed's
    `ZERO_SUPPORTED_OPTIMIZERS`. Opt-in; idempotent."""
    from .integrations.deepspeed.registry import register_deepspeed as register

    register()


def __getattr__(name: str):
    # `deepspeed_initialize` is `coat_ds.integrations.deepspeed.initialize` itself (its signature
    # and doc, not a wrapper's), loaded on first use so that FSDP-only users never load the
    # DeepSpeed integration.
    if name == "deepspeed_initialize":
        from .integrations.deepspeed import initialize

        globals()[name] = initialize
        return initialize
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | {"deepspeed_initialize"})


__all__ = ["prepare", "RecipeConfig", "PrepareReport", "CoatAdamW", "OptimStateConfig", "AdamWHyperparams",
           "compress_activations", "ActivationConfig", "ActivationStats", "activation_stats",
           "convert_to_fp8_linear", "Fp8Linear", "Fp8LinearConfig", "fuse_rms_norms", "fuse_swiglu",
           "fuse_lm_head_loss",
           "fsdp", "FsdpConfig", "setup_fsdp", "deepspeed_initialize",
           "register_deepspeed", "Plan", "load_plan", "apply_plan", "ApplyConfig"]
__version__ = "0.1.0"
