"""Benchmarks that run a whole serving stack: vLLM, vllm-router, a transformers model.

They sit beside the package, not in it (as vLLM and LMCache keep theirs): each needs an engine
that kvtier itself does not depend on, and none serves an operator who runs kvtier alone. Run
them from a checkout with ``python -m benchmarks NAME [--json]``; ``kvtier bench NAME`` runs
the ones that need nothing but kvtier. :mod:`.harness` holds what they and the tests build in
code (tiny model families, vllm-router and vLLM servers).
"""
