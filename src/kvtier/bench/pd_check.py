"""The byte check behind every ``kvtier bench pd`` figure: after timing a transport, one
more request keyed by real tokens with seeded KV, which the decoder looks up and retrieves;
the bench fails unless every byte it served equals what was sent. See :mod:`kvtier.bench.pd`."""

from __future__ import annotations

import argparse
from multiprocessing.connection import Connection

import torch

from kvtier.bench.pd_decoder import CHUNK_TOKENS, LAYOUT, MODEL, ServeCheck, digest
from kvtier.fingerprint import Fingerprint
from kvtier.keys import KeyChain
from kvtier.pd.sender import OutChunk, PDSender, chunks_from_kv


def _check_source(fingerprint: str, num_chunks: int) -> tuple[list[int], list[OutChunk], str]:
    """The checked request: seeded tokens, their chunk keys as the decoder computes them, KV
    of seeded random bytes, and the digest the decoder's retrieve must match."""
    chain = KeyChain(Fingerprint(model_name=MODEL, layout=LAYOUT, chunk_size=CHUNK_TOKENS))
    if chain.fingerprint.hex() != fingerprint:
        raise AssertionError("bench pd: the decoder hashes its keys another way than the bench")
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 32000, (num_chunks * CHUNK_TOKENS,), generator=generator).tolist()
    shape = LAYOUT.kv_shape(len(tokens))
    ints = torch.randint(-(2**15), 2**15, shape, generator=generator)
    kv = (ints.to(torch.float32) / 2**13).to(LAYOUT.dtype)  # no NaN: bytes compare as values
    spans = chain.keys(tokens, include_partial=False)
    return tokens, chunks_from_kv(spans, kv), digest(kv)


def check_transfer(
    channel: str,
    sender: PDSender,
    request_id: str,
    control: Connection,
    fingerprint: str,
    num_chunks: int,
    args: argparse.Namespace,
) -> ServeCheck:
    """After timing: one more request of ``num_chunks`` chunks over the same sender, keyed by
    real tokens, which the decoder looks up and retrieves (its serve-time checks included);
    every retrieved byte must equal the source. Raises :class:`AssertionError` otherwise,
    so a transport that moves wrong bytes reports a failure, never a figure."""
    tokens, chunks, expected = _check_source(fingerprint, num_chunks)
    control.send((tokens, args.repeats))  # announced before the request can arrive
    sender.send(request_id, chunks)
    if not control.poll(300.0):
        raise AssertionError(f"bench pd {channel}: the decoder did not answer the byte check")
    served: ServeCheck = control.recv()
    problems = []
    if not served.transfer_ok:
        problems.append("the decoder recorded the transfer as failed")
    if served.hit_tokens != len(tokens) or served.loaded_tokens != len(tokens):
        problems.append(
            f"found {served.hit_tokens} and loaded {served.loaded_tokens} of {len(tokens)} tokens"
        )
    elif any(d != expected for d in served.digests):
        problems.append("the bytes served differ from the bytes sent")
    if problems:
        raise AssertionError(f"bench pd {channel}: " + "; ".join(problems))
    return served
