"""What an operator sees: counters and histograms (:mod:`.metrics`), the per-request lookup
explanation (:mod:`.explain`) and the hooks the engine calls to feed both (:mod:`.observer`).

Nothing here starts a thread or imports a web framework; the HTTP side is :mod:`kvtier.admin`.
"""
