"""Connectors between kvtier and inference engines.

Only :mod:`kvtier.integrations.transformers` exists so far; import it explicitly (it needs the
``transformers`` package, which the rest of kvtier does not).
"""
