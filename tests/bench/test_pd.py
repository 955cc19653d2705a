"""``kvtier bench pd``: every field, and a failure (not a figure) when the bytes that arrive
differ from the bytes sent, on each transport's timed path."""

from __future__ import annotations

import argparse
import json
import os
import socket

import pytest
import torch

from kvtier.bench import pd
from kvtier.config.channels import nixl_installed
from kvtier.pd.channels.shm import ShmSender
from kvtier.pd.channels.shm_segments import PREFIX
from kvtier.pd.channels.tcp import TcpSender
from tests.bench.bench_checks import assert_spread
from tests.pd.test_pd_demo import kvtier


def pd_segments() -> set[str]:
    """kvtier's PD receive segments in /dev/shm whose owner process is gone (leaked): those
    of live processes are other tests' at work."""
    return {
        name
        for name in os.listdir("/dev/shm")
        if name.startswith(PREFIX) and not _alive(int(name[len(PREFIX) :].split("-")[0]))
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_bench_pd_reports_every_field() -> None:
    shm_before = pd_segments()
    # Two-chunk requests: the checked request is served through one staging page per chunk.
    done = kvtier(
        "bench", "pd", "--json", "--chunks", "2", "--repeats", "1", "--pages", "2",
        "--request-chunks", "2",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    # Each ratio is the median of its pairs, with their spread; where both figures come from
    # the same pairs, their quotient lies within it.
    assert result["pairs"] == 1 and result["load_1m"] >= 0
    assert_spread(result, "shm_ratio")
    assert_spread(result, "shm_ratio_streaming")
    assert_spread(result, "tcp_ratio", "tcp_gbps", "raw_socket_gbps")
    assert_spread(result, "shm_serve_ratio", "shm_serve_gbps", "shm_serve_memcpy_gbps")
    assert result["tcp_serve_gbps"] > 0
    # The transfer and the serve one after the other: 1 / (1/shm + 1/serve).
    together = 1 / (1 / result["shm_gbps"] + 1 / result["shm_serve_gbps"])
    assert result["shm_with_serve_gbps"] == pytest.approx(together, rel=1e-9)
    assert result["shm_with_serve_ratio"] == pytest.approx(
        2 * together / result["memcpy_gbps"], rel=1e-9
    )
    assert result["bytes_checked"] is True
    # Its decoders closed (never killed): their receive segments left /dev/shm with them.
    assert pd_segments() - shm_before == set()
    assert result["shm_with_serve_gbps"] < result["shm_gbps"]
    assert result["streaming_copy_built"] is True
    assert result["copy_hash_built"] is True and result["hash_isa"]
    if nixl_installed():
        assert_spread(result, "nixl_ratio")
    else:
        assert result["nixl_gbps"] is None and "nixl" in result["nixl_reason"]


def _args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    pd.add_arguments(parser)
    return parser.parse_args(["--chunks", "1", "--repeats", "1", "--pages", "1"])


def test_bench_pd_fails_when_shm_pages_hold_a_flipped_byte(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The timed shm path: the sender writes the decoder's page and sends its checksum. A
    byte changed in the page after that (a stray write) must come out of the bench as a
    failure: the decoder's serve-time check turns the chunk into a miss."""
    send_chunk = ShmSender.send_chunk

    def flipping(
        self: ShmSender, sock: socket.socket, rid: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        nbytes = send_chunk(self, sock, rid, index, page, data)
        assert self._buffer is not None
        self._buffer[page * self._page_bytes + nbytes // 2] ^= 0x01
        return nbytes

    monkeypatch.setattr(ShmSender, "send_chunk", flipping)
    with pytest.raises(AssertionError, match=r"bench pd shm: found \d+ and loaded 0 of"):
        pd.run(_args())


def test_bench_pd_fails_when_tcp_delivers_other_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The timed tcp path with a sender that puts one wrong byte on the wire under a checksum
    of those wrong bytes: the receiver accepts it, and only comparing what the decoder serves
    with the source catches it."""
    send_chunk = TcpSender.send_chunk

    def flipping(
        self: TcpSender, sock: socket.socket, rid: str, index: int, page: int, data: torch.Tensor
    ) -> int:
        wrong = data.contiguous().clone()
        wrong.view(-1).view(torch.uint8)[7] ^= 0x01
        return send_chunk(self, sock, rid, index, page, wrong)

    monkeypatch.setattr(TcpSender, "send_chunk", flipping)
    with pytest.raises(AssertionError, match="bench pd tcp: the bytes served differ"):
        pd.run(_args())
