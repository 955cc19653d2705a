"""What the tests and the serving-stack benchmarks build in code: not the product.

Tiny model families of the architectures users deploy (:mod:`.families`, :mod:`.vision`,
:mod:`.shapes`), vLLM servers behind vllm-router (:mod:`.router`), all without a download, and
the state families' prefix reuse at vLLM's defaults (:mod:`.state_reuse`).
The tiny models the demo runs live in the package (:mod:`kvtier.demo.tiny_models`,
:mod:`kvtier.demo.checkpoint`); nothing in the package imports this folder.
"""
