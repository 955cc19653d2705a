"""Group-structured chunks through a real ``kvtier server``: the layout's groups travel in the
client's Hello, the server keys and sizes pages by them, and what one client stores another
reads back exactly as an in-process engine would (a trimmed sliding group, an MLA latent)."""

from __future__ import annotations

import pytest
import torch

from kvtier import Config, Engine, InputError
from kvtier.layout import KVLayout
from tests.conftest import make_kv, make_tokens
from tests.group_layouts import CHUNK, GEMMA, LAYOUT_IDS, LAYOUTS, kept
from tests.server.server_helpers import ServerProcess, open_client


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_a_group_layout_is_served_like_an_in_process_engine(
    server: ServerProcess, layout: KVLayout
) -> None:
    tokens = make_tokens(3 * CHUNK + 3, seed=40)
    kv = make_kv(len(tokens), seed=41, layout=layout)
    model = f"groups-{layout.describe_groups()}"
    with open_client(server.url, layout, model_name=model) as writer:
        assert writer.store(tokens, kv) == 3
    with open_client(server.url, layout, model_name=model) as reader:
        with reader.request("r"):
            assert reader.lookup(tokens, "r").tokens == 3 * CHUNK
            got = reader.retrieve(tokens, "r")
        assert reader.stats()["open_requests"] == 0
    assert torch.equal(got, kept(kv[:, :, : 3 * CHUNK], layout))
    cfg = Config.load(
        overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{4 * layout.chunk_bytes(CHUNK)}B"},
        env={},
    )
    with Engine(cfg, layout, model_name=model) as engine:
        engine.store(tokens, kv)
        assert engine.lookup(tokens, "e").tokens == 3 * CHUNK
        assert torch.equal(engine.retrieve(tokens, "e"), got)
        engine.end_request("e")


def test_another_group_layout_of_the_same_model_never_shares_a_chunk(
    server: ServerProcess,
) -> None:
    """The groups (kinds, windows, kept tokens, layers) are in the fingerprint the server
    keys by: the same model name with untrimmed groups finds nothing."""
    from kvtier.layout import GroupKind, KVGroup

    untrimmed = KVLayout(
        4,
        2,
        8,
        torch.float32,
        groups=(KVGroup(GroupKind.SLIDING, (0, 2), 4), KVGroup(GroupKind.FULL, (1, 3))),
    )
    tokens = make_tokens(2 * CHUNK, seed=42)
    with open_client(server.url, GEMMA, model_name="groups-shared-name") as client:
        client.store(tokens, make_kv(len(tokens), seed=43, layout=GEMMA))
    other = open_client(server.url, untrimmed, model_name="groups-shared-name")
    with other, other.request("o"):
        assert other.lookup(tokens, "o").tokens == 0


@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
def test_retrieve_into_a_buffer_of_the_layouts_own_planes_through_the_server(
    server: ServerProcess, layout: KVLayout
) -> None:
    """``retrieve_into`` takes the buffer the layout describes (``[planes, layers, >=hit,
    hidden]``: one latent plane for MLA) behind a server as in-process, and fills it with
    the same bytes. Before, the client asked for 2 planes: an MLA model behind ``kvtier
    server`` refused every load."""
    tokens = make_tokens(2 * CHUNK + 5, seed=44)
    kv = make_kv(len(tokens), seed=45, layout=layout)
    model = f"groups-into-{layout.describe_groups()}"
    with open_client(server.url, layout, model_name=model) as writer:
        assert writer.store(tokens, kv) == 2
    out = torch.zeros(layout.kv_shape(len(tokens)), dtype=layout.dtype)
    with open_client(server.url, layout, model_name=model) as reader:
        with reader.request("r"):
            assert reader.lookup(tokens, "r").tokens == 2 * CHUNK
            assert reader.retrieve_into(tokens, "r", out) == 2 * CHUNK
        short = torch.zeros(layout.kv_shape(CHUNK), dtype=layout.dtype)
        with reader.request("s"), pytest.raises(InputError, match=f">={2 * CHUNK}"):
            reader.retrieve_into(tokens, "s", short)  # the same check, once the hit is known
        if layout.planes != 2:  # a K-and-V buffer is not this layout's
            two = torch.zeros((2, *layout.kv_shape(len(tokens))[1:]), dtype=layout.dtype)
            with pytest.raises(InputError, match=f"out must be .* \\[{layout.planes}, "):
                reader.retrieve_into(tokens, "t", two)
        assert reader.stats()["open_requests"] == 0
    assert torch.equal(out[:, :, : 2 * CHUNK], kept(kv[:, :, : 2 * CHUNK], layout))
    cfg = Config.load(
        overrides={"chunk_size": CHUNK, "max_local_cpu_size": f"{4 * layout.chunk_bytes(CHUNK)}B"},
        env={},
    )
    with Engine(cfg, layout, model_name=model) as engine, engine.request("e"):
        engine.store(tokens, kv)
        in_process = torch.zeros_like(out)
        assert engine.lookup(tokens, "e").tokens == 2 * CHUNK
        assert engine.retrieve_into(tokens, "e", in_process) == 2 * CHUNK
    assert torch.equal(in_process, out)
