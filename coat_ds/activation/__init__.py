"""FP8 storage of the tensors autograd saves for backward (COAT's activation compression)."""
from .accounting import ActivationStats
from .api import ActivationCompression, activation_stats, compress_activations

__all__ = ["compress_activations", "ActivationCompression", "ActivationStats", "activation_stats"]
