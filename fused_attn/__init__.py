"""fused_attn: exact multi-head attention for PyTorch, fused."""

from .backends.registry import BackendError, available_backends, use_backend
from .functional import attention, split_heads_attention

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "attention",
    "available_backends",
    "split_heads_attention",
    "use_backend",
]
