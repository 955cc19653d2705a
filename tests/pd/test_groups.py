"""Group-structured chunks through PD, prefiller to decoder over real sockets: the sender
packs a trimmed sliding group (only the tokens it keeps go on the wire), the receiver sizes
and checks each chunk by the layout, and the decoder serves exactly what was kept."""

from __future__ import annotations

import pytest
import torch

from kvtier import Engine
from kvtier.layout import KVLayout
from kvtier.pd.receiver import PDReceiver
from kvtier.pd.sender import PDSender, chunks_from_kv
from tests.conftest import make_kv, make_tokens, small_config
from tests.group_layouts import CHUNK, LAYOUT_IDS, LAYOUTS, kept


@pytest.mark.parametrize("channel", ["tcp", "shm"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_a_group_layout_crosses_pd_and_is_served_by_the_decoder(
    layout: KVLayout, channel: str
) -> None:
    page = layout.chunk_bytes(CHUNK)
    cfg = small_config(
        chunk_size=CHUNK,
        max_local_cpu_size=f"{8 * page}B",
        enable_pd=True,
        pd_role="receiver",
        pd_buffer_size=f"{8 * page}B",
        transfer_channel=channel,
        save_unfull_chunk=True,
        local_cpu=False,
    )
    tokens = make_tokens(3 * CHUNK + 5, seed=50)
    kv = make_kv(len(tokens), seed=51, layout=layout)
    with Engine(cfg, layout, model_name="pd-groups") as decoder:
        receiver = PDReceiver.for_engine(decoder, port=0).open()
        try:
            tx = PDSender(
                fingerprint=decoder.fingerprint.hex(),
                layout=layout,
                chunk_size=CHUNK,
                host="127.0.0.1",
                port=receiver.port,
                channel=channel,
                alloc_timeout=2.0,
            )
            with tx:
                spans = decoder.keychain.keys(tokens, include_partial=True)
                report = tx.send("t1", chunks_from_kv(spans, kv))
            assert report.sent == 4
            assert report.nbytes == sum(layout.payload_bytes(s.num_tokens) for s in spans)
            assert decoder.lookup(tokens, "r").tokens == len(tokens)
            got = decoder.retrieve(tokens, "r")
            decoder.end_request("r")
            decoder.end_request("t1")
            want = kept(kv, layout)
            assert torch.equal(got, want)
            assert decoder.check_invariants() == []
        finally:
            receiver.close()
