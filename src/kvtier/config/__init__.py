"""Typed, frozen, validated configuration.

Sources, later wins: defaults, then a YAML file (``KVTIER_CONFIG_FILE``, else
``LMCACHE_CONFIG_FILE``, or the path given), then environment variables (``KVTIER_<KEY>``,
and ``LMCACHE_<KEY>`` for keys LMCache also has; ``KVTIER_`` wins), then explicit overrides.
Every value is parsed by its key's row in :mod:`kvtier.config.schema`; a bad value raises
:class:`~kvtier.errors.ConfigError` naming the key. Unknown keys are named in one warning.
"""

from kvtier.config.model import Config

__all__ = ["Config"]
