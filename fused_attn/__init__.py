"""fused_attn: exact multi-head attention for PyTorch, fused."""

from .backends.registry import BackendError, available_backends, use_backend
from .flex import flex_attention
from .functional import attention, split_heads_attention
from .kvcache import attention_with_kvcache
from .modules import MultiheadAttention, TransformerEncoderLayer, replace_attention
from .integrations.sdpa import redirect_sdpa
from .integrations import sdpa_plugin as _sdpa_plugin
from .varlen import attention_varlen

__version__ = "0.1.0"

# Only the name: torch.nn.attention.activate_flash_attention_impl("fused_attn") registers the kernels.
_sdpa_plugin.register()

__all__ = [
    "BackendError",
    "MultiheadAttention",
    "TransformerEncoderLayer",
    "attention",
    "attention_varlen",
    "attention_with_kvcache",
    "available_backends",
    "flex_attention",
    "redirect_sdpa",
    "replace_attention",
    "split_heads_attention",
    "use_backend",
]
