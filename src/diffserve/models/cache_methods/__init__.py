"""Cache accelerators by the names users know (DBCache, TaylorSeer, TeaCache, MagCache, SCM, EasyCache, SeaCache),
per request.

`configs/cache_settings.py` declares each method's settings; here each method is one file (its per-request
state, `base.RequestCache`), `registry.py` maps settings to states, `batch.py` runs one DiT forward over
requests that cache differently, and `blocks.py` is what a DiT exposes to run its blocks in ranges.
"""
