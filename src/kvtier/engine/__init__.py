"""The engine: the cache of one model (one tensor-parallel rank) over this process's tiers.

One public class, :class:`Engine` (:mod:`kvtier.engine.engine`); the modules with a leading
underscore are the package's own, imported by nothing outside it::

    engine.py          Engine: open/close, lookup, retrieve, store, end_request, stats
      ├── _pages.py        engine.pages(): the same calls without the copy, for a process
      │                    that maps the page buffer (the kvtier server)
      ├── _checkpoints.py  a state model's lookup that may end inside a chunk
      └── _core.py         what engine.py and _pages.py share: the call guard, the parts that
                           exist while open, a request's keys, lookup, load and end
"""

from kvtier.engine.engine import Engine, EngineState

__all__ = ["Engine", "EngineState"]
