"""The compiled extension `fused_attn._C`, if it was built; the package works without it."""

try:
    from . import _C  # noqa: F401  (importing it registers the C++ ops with torch.library)

    missing_reason = None
except ImportError as error:
    _C = None
    missing_reason = f"the C++ extension fused_attn._C is not built or failed to load ({error})"
