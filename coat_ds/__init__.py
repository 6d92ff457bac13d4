"""coat_ds: memory-efficient FP8 training (COAT) for DeepSpeed and PyTorch FSDP."""
from .activation import ActivationStats, activation_stats, compress_activations
from .config import ActivationConfig, AdamWHyperparams, OptimStateConfig
from .optim import CoatAdamW
from .integrations.deepspeed import initialize as deepspeed_initialize

__all__ = ["CoatAdamW", "OptimStateConfig", "AdamWHyperparams",
           "compress_activations", "ActivationConfig", "ActivationStats", "activation_stats"]
__all__ += ["deepspeed_initialize"]
__version__ = "0.1.0"
