"""coat_ds: memory-efficient FP8 training (COAT) for DeepSpeed and PyTorch FSDP."""
from .activation import ActivationStats, activation_stats, compress_activations
from .config import ActivationConfig, AdamWHyperparams, OptimStateConfig
from .optim import CoatAdamW

__all__ = ["CoatAdamW", "OptimStateConfig", "AdamWHyperparams",
           "compress_activations", "ActivationConfig", "ActivationStats", "activation_stats"]
__version__ = "0.1.0"
