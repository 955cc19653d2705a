"""A coded CPU tier's load into device memory: its chunks are decoded into a staging page and
copied from there, and the next chunk decodes into the same page, so each chunk's copy must
land before the page is written again (kvtier.storage.loads: a staging page's own batch).

No GPU here: copies into "device" memory land only when code waits on their fence, or when
the test drains them (tests/memory/late_copies.py). With a fence that lies ("landed" at once,
no wait) the device must get the wrong bytes, so the scenario can fail."""

from __future__ import annotations

import pytest
import torch

from kvtier import Engine
from tests.conftest import SMALL_CHUNK, SMALL_LAYOUT, make_kv, make_tokens, small_config
from tests.memory.late_copies import LateCopies

CHUNKS = 4
TOKENS = CHUNKS * SMALL_CHUNK
PAGE = SMALL_LAYOUT.chunk_bytes(SMALL_CHUNK)


@pytest.mark.parametrize("lying", [False, True], ids=["fenced", "lying-fence"])
def test_a_staging_page_is_decoded_into_again_only_after_its_copy_to_the_device_landed(
    lying: bool,
) -> None:
    copies = LateCopies(lying=lying)
    tokens, kv = make_tokens(TOKENS, 47001), make_kv(TOKENS, 47001)
    # One staging page: every chunk of the load is decoded into it in turn.
    cfg = small_config(cpu_chunks=16, cpu_codec="lossless", cpu_codec_staging=f"{PAGE}B")
    out = copies.mark(torch.zeros_like(kv))
    with Engine(cfg, SMALL_LAYOUT, model_name="fence", copies=copies) as engine:
        assert engine.store(tokens, kv) == CHUNKS  # host KV: copied at once
        assert engine.lookup(tokens + [1], "r").tokens == TOKENS
        assert engine.retrieve_into(tokens + [1], "r", out) == TOKENS
        assert copies.batches == CHUNKS  # one batch per chunk, each through the page
        engine.end_request("r")
        copies.drain()
        assert engine.check_invariants() == []
    assert torch.equal(out, kv) is not lying
