"""kvtier's PD transfer inside vLLM's worker (integrations/vllm/pd.py): a salted request's
transfer is charged to its tenant's share of the decoder's receive buffer, because the
prefiller's worker sends the request's ``cache_salt`` with it (real Engines, a real PD
receiver on loopback, no vLLM processes, as in test_pd_handoff.py)."""

from __future__ import annotations

from types import SimpleNamespace

from kvtier.integrations.vllm.rpc import LookupClient

from .test_pd_handoff import ROUTER_PREFILL, TOKENS, scheduler, step
from .worker_helpers import CHUNK_BYTES, fill, make_worker


def test_a_salted_requests_transfer_counts_against_its_tenants_share_on_the_decoder() -> None:
    decoder = make_worker(
        enable_pd=True,
        pd_role="receiver",
        pd_buffer_size=f"{4 * CHUNK_BYTES}B",
        tenant_quotas={"alice": "50%"},
    )
    assert decoder.service is not None and decoder.service.receiver is not None
    prefiller = make_worker(
        enable_pd=True,
        pd_role="sender",
        pd_peer_host="127.0.0.1",
        pd_peer_alloc_port=[decoder.service.receiver.port],
    )
    client = LookupClient(decoder.engine_id)
    try:
        p_side = scheduler(prefiller, loads=True, saves=True, pd_sender="prefiller-1")
        src = [3, 4, 5, 6, 7]
        fill(prefiller, src, seed=1)
        salted = SimpleNamespace(
            request_id="p1",
            prompt_token_ids=TOKENS,
            kv_transfer_params=dict(ROUTER_PREFILL),
            cache_salt="alice",
        )
        assert p_side.num_new_matched_tokens(salted, 0) == (0, False)
        p_side.after_alloc(salted, src, 0)
        prefiller.save(step(p_side, "p1", src, 0, len(TOKENS)))
        tenants = client.stats()["tiers"]["pd"]["tenants"]
        assert tenants["alice"]["held_bytes"] == 2 * CHUNK_BYTES  # its 2 whole chunks
        assert tenants["alice"]["limit_bytes"] == 2 * CHUNK_BYTES
        assert "" not in tenants  # nothing charged to the unsalted tenant
        p_side.close()
    finally:
        client.close()
        prefiller.close()
        decoder.close()
