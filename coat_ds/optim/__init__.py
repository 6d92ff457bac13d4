from .coat_adamw import CoatAdamW, nonfinite_groups

__all__ = ["CoatAdamW", "nonfinite_groups"]
