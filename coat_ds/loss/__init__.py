"""The LM head's loss without its full logits: chunked linear cross-entropy (linear_ce.py)
and `fuse_lm_head_loss` for Hugging Face causal LMs and coat_ds's own Llama (fuse.py)."""
from .fuse import SUPPORTED, fuse_lm_head_loss
from .linear_ce import default_chunk_tokens, linear_cross_entropy

__all__ = ["fuse_lm_head_loss", "linear_cross_entropy", "default_chunk_tokens", "SUPPORTED"]
