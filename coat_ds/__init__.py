"""coat_ds: memory-efficient FP8 training (COAT) for DeepSpeed and PyTorch FSDP."""
from .activation import ActivationStats, activation_stats, compress_activations
from .config import ActivationConfig, AdamWHyperparams, Fp8LinearConfig, OptimStateConfig
from .integrations import fsdp
from .integrations.fsdp import FsdpConfig, setup_fsdp
from .linear import Fp8Linear, convert_to_fp8_linear
from .optim import CoatAdamW


def deepspeed_initialize(*args, **kwargs):
    """`coat_ds.integrations.deepspeed.initialize`, imported on first call so that FSDP-only
    users never load the DeepSpeed integration."""
    from .integrations.deepspeed import initialize

    return initialize(*args, **kwargs)


__all__ = ["CoatAdamW", "OptimStateConfig", "AdamWHyperparams",
           "compress_activations", "ActivationConfig", "ActivationStats", "activation_stats",
           "convert_to_fp8_linear", "Fp8Linear", "Fp8LinearConfig",
           "fsdp", "FsdpConfig", "setup_fsdp", "deepspeed_initialize"]
__version__ = "0.1.0"
