"""Device memory a load holds (whole-chunk mode): KV on a device is loaded through host
staging and a window of a few chunks, never a prompt-sized device scratch, and each window
is scattered only after its copy landed (kvtier.integrations.vllm.loads).

The "device" is host memory marked for a gated copy engine whose copies run only when their
fence is waited for: a scatter that skipped the wait would read an empty window.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kvtier.integrations.vllm.loads import WINDOW_CHUNKS
from kvtier.integrations.vllm.metadata import KVTierMetadata, LoadSpec, SaveSpec
from tests.integrations.vllm.test_layerwise_worker import Gated
from tests.integrations.vllm.worker_helpers import BLOCK, CHUNK, fill, make_worker, scheduler_for

TOKENS = list(range(500, 700))  # 200 tokens: 6 whole chunks of 32 + 8
SRC = list(range(1, 14))  # 13 blocks of 16
DST = list(range(30, 43))


def test_a_long_load_holds_a_window_of_device_memory_not_the_prompt() -> None:
    worker = make_worker()
    try:
        assert worker.paged is not None and worker._loads is not None
        fill(worker, SRC, seed=3)
        for start in range(0, 192, CHUNK):  # one chunk per save: its scratch stays 1 chunk
            end = start + CHUNK
            worker.save(KVTierMetadata(saves=[SaveSpec("r1", TOKENS[:end], SRC, start, end)]))

        gated = Gated(lazy=True)
        for layer in worker.paged.layers:
            gated.mark(layer)
        window = WINDOW_CHUNKS * CHUNK
        assert worker._buffers is not None
        gated.mark(worker._buffers.scratch_rows(window))  # the model thread's device buffer
        worker._loads.copies = gated

        scheduler = scheduler_for(worker)
        request = SimpleNamespace(request_id="r2", prompt_token_ids=TOKENS)
        assert scheduler.num_new_matched_tokens(request, 0) == (192, False)
        scheduler.after_alloc(request, DST, 192)
        new = SimpleNamespace(
            req_id="r2", prompt_token_ids=TOKENS, block_ids=(DST,), num_computed_tokens=0
        )
        step = SimpleNamespace(
            preempted_req_ids=set(),
            scheduled_new_reqs=[new],
            num_scheduled_tokens={"r2": 8},
            scheduled_cached_reqs=SimpleNamespace(req_ids=[]),
        )
        meta = scheduler.build_meta(step)
        assert meta.loads == [LoadSpec("r2", TOKENS, DST, 0, 192)]
        worker.load(meta)

        full = 192 // BLOCK
        for layer in worker.paged.layers:
            assert torch.equal(layer[DST[:full]], layer[SRC[:full]])
        assert worker.failed_blocks() == set() and worker.short_loads() == {}
        assert len(gated.gates) == -(-192 // window)  # one batch, one fence per window
        # The prompt's 200 tokens would take 224 rows; the load held one window.
        assert worker.scratch_tokens == window
        assert worker.stats()["scratch_tokens"] == window
        scheduler.finished("r2")
    finally:
        worker.close()
