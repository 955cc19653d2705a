"""Fixtures built in code for the tests, ``kvtier demo`` and ``kvtier bench``: not the product.

Everything here makes something a real run needs without a download: small transformers
models with seeded random weights (:mod:`.tiny_models`) and a tiny Llama checkpoint written to
disk for vLLM (:mod:`.checkpoint`). They sit above the product in the layer order
(``tests/test_layers.py``): they may use any product module, and only ``demo``, ``bench``,
``cli`` and the tests may import them, so nothing a user deploys depends on a fixture.
"""
