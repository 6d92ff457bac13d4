from .coat_adamw import CoatAdamW

__all__ = ["CoatAdamW"]
