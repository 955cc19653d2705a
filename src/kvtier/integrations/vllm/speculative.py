"""Speculative decoding and multi-token prediction: which vLLM setups kvtier serves.

vLLM's ``speculative_config.method`` says where draft tokens come from. kvtier stores the
target model's KV-cache groups (:mod:`.groups`) for prompt tokens; a draft that keeps no KV
of its own leaves those exactly as without speculation, so kvtier serves it::

    ngram, ngram_gpu, suffix      drafts from the tokens already seen: no draft KV   served
    eagle, eagle3, mtp, dflash,   draft layers with their own KV, computed from the  off
      dspark, draft_model,          target's hidden states; vLLM drops the last
      extract_hidden_states,        matched block of its own prefix cache for them
      medusa, mlp_speculator,       (and MTP keeps extra sliding-window tokens):
      custom_class, anything new    kvtier stores none of that, so a hit would give
                                    the draft a cache it never had

A setup kvtier does not serve turns kvtier off for the model with one warning, as a
KV-cache group it does not model does (:meth:`.groups.ModelGroups.warn_off`): vLLM serves
it with its own prefix cache, never a failed start. Drafts that keep no KV but read the
target's hidden states (medusa, mlp_speculator) are off too: untested here, so fail closed.
"""

from __future__ import annotations

from typing import Any

# Methods whose drafts come from token history alone: no draft KV, no hidden states.
SERVED = frozenset({"ngram", "ngram_gpu", "suffix"})


def speculative_refusal(speculative_config: Any) -> str:
    """Why kvtier cannot serve vLLM's speculative setup ('' if none or it can)."""
    if speculative_config is None:
        return ""
    method = getattr(speculative_config, "method", None)
    if method in SERVED:
        return ""
    return (
        f"vLLM runs speculative decoding with method {method!r}, whose draft keeps KV or "
        f"hidden states kvtier does not store (kvtier serves {', '.join(sorted(SERVED))})"
    )
