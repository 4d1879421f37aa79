"""Adapters that put fused_attn inside other libraries' code, above the public functions.

`sdpa`: `redirect_sdpa`, which needs torch only and is exported as `fused_attn.redirect_sdpa`.
`transformers`: imports transformers, so `import fused_attn` leaves it out; import it to register.
"""
