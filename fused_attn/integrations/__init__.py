"""Adapters that put fused_attn inside other libraries' models. Each imports its library only when
imported itself, so `import fused_attn` never pulls them in."""
