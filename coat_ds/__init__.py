"""coat_ds: memory-efficient FP8 training (COAT) for DeepSpeed and PyTorch FSDP."""
from .config import AdamWHyperparams, OptimStateConfig
from .optim import CoatAdamW

__all__ = ["CoatAdamW", "OptimStateConfig", "AdamWHyperparams"]
__version__ = "0.1.0"
