"""``kvtier pd-demo``: prefill/decode disaggregation between two processes on loopback.

Three processes: this one (the proxy) hands each request to a prefiller and a decoder, both
spawned. The prefiller (``pd_role: sender``) prefills the prompt with a small model built in
code and sends the prompt's KV chunks into the decoder's receive buffer; the decoder
(``pd_role: receiver``) waits for the transfer's outcome, loads the prefix from its PD tier
through the transformers connector (prefilling locally only what did not arrive), generates,
and ends the request, which gives the buffer pages back. Most requests share one of a few
system prompts (LMCache's reproduction for the leak of change #2847), so the decoder often
holds chunks already; a few prompts are larger than the whole buffer and fall back to a local
prefill.

The decoder also generates every answer without any cache; the demo fails (exit 1) if any
answer differs, or if the buffer is not entirely free at the end.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

from kvtier.config import Config

SPAWN = multiprocessing.get_context("spawn")  # forking after torch is imported can hang


@dataclass(frozen=True)
class Sent:
    """The prefiller's view of one request's transfer."""

    request_id: str
    chunks: int
    held: int
    nbytes: int
    seconds: float  # moving the chunks (waiting for room excluded)
    error: str = ""


@dataclass(frozen=True)
class Answer:
    """The decoder's view of one request."""

    request_id: str
    transferred: bool
    reused_tokens: int
    prompt_tokens: int
    pages_used: int  # buffer occupancy when the decoder started the request
    same_as_local: bool


@dataclass(frozen=True)
class EndState:
    free_pages: int
    num_pages: int
    leaks: int
    problems: list[str]


def add_parser(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "--requests",
        type=int,
        default=40,
        help="requests to send; every 20th is larger than the decoder's whole buffer "
        "(default: %(default)s)",
    )
    add("--channel", choices=("tcp", "shm", "nixl"), default="tcp", help="transfer_channel")
    add("--model-size", default="tiny", help="model built in code (tiny, small, medium)")
    add("--chunk-size", type=int, default=32, help="tokens per chunk")
    add("--buffer-chunks", type=float, default=8.5, help="pd_buffer_size, in chunks")
    add("--system-tokens", type=int, default=96, help="shared system prompt length")
    add("--new-tokens", type=int, default=8, help="tokens generated per request")
    add(
        "--seed",
        type=int,
        default=0,
        help="seed of the prompts and of the model's random weights (default: %(default)s)",
    )


def _config(args: argparse.Namespace, role: str, chunk_bytes: int, port: int) -> Config:
    overrides: dict[str, Any] = {
        "chunk_size": args.chunk_size,
        "max_local_cpu_size": f"{64 * chunk_bytes}B",
        "save_unfull_chunk": True,  # PD ships the prompt's tail too
        "enable_pd": True,
        "pd_role": role,
        "transfer_channel": args.channel,
        "pd_peer_host": "127.0.0.1",
        "pd_allocation_timeout_sec": 5.0,
    }
    if role == "receiver":
        overrides["pd_buffer_size"] = f"{int(args.buffer_chunks * chunk_bytes)}B"
        overrides["local_cpu"] = False  # the decoder keeps nothing beyond its requests
    else:
        overrides["pd_peer_alloc_port"] = port
    return Config.load(env={}, overrides=overrides)


def _model(args: argparse.Namespace) -> Any:
    import torch

    from kvtier.demo.tiny_models import build_model

    # Two model processes share this host: one intra-op thread each, so neither spins on the
    # cores the other (and the receiver thread) needs.
    torch.set_num_threads(1)
    return build_model("llama", args.model_size, seed=args.seed)


def decoder_main(args: argparse.Namespace, jobs: Any, results: Any) -> None:
    """Decoder process: receive, load, generate, compare with local generation, end."""
    from kvtier.integrations.hf_kv import layout_from_model
    from kvtier.integrations.transformers import HFConnector
    from kvtier.service import Service

    model = _model(args)
    layout = layout_from_model(model)
    config = _config(args, "receiver", layout.chunk_bytes(args.chunk_size), 0)
    # The Service opens the engine, then its PD receiver (pd_role receiver, 127.0.0.1, a free
    # port), and closes them in reverse.
    with Service(config, layout, model_name=f"llama-{args.model_size}") as service:
        engine, receiver = service.engine, service.receiver
        tier = engine.receiver_host().pd_buffer
        assert receiver is not None and tier is not None
        results.put(("ready", receiver.port, tier.num_pages))
        connector = HFConnector(engine, model)
        local = HFConnector(None, model)
        while (job := jobs.get()) is not None:
            rid, prompt = job
            outcome = receiver.wait_outcome(rid, 60.0)
            used = tier.pool.used_pages  # occupancy while this request's KV sits in the buffer
            gen = connector.generate(prompt, args.new_tokens, request_id=rid, store=False)
            ref = local.generate(prompt, args.new_tokens, use_cache=False, store=False)
            answer = Answer(
                rid,
                outcome is not None and outcome.ok,
                gen.reused_tokens,
                len(prompt),
                used,
                gen.tokens == ref.tokens,
            )
            results.put(answer)
            engine.end_request(rid)  # no-op: the connector already ended it; kept for clarity
        receiver.close()  # early (the Service closes it again, a no-op): no transfer lands now
        leaks = len(engine.leaks())
        results.put(
            EndState(tier.pool.free_pages, tier.num_pages, leaks, engine.check_invariants())
        )


def prefiller_main(args: argparse.Namespace, port: int, jobs: Any, results: Any) -> None:
    """Prefiller process: prefill (reusing its own cache), send the KV, report the transfer."""
    from kvtier.errors import TransferError
    from kvtier.integrations.hf_kv import kv_from_cache, layout_from_model
    from kvtier.integrations.transformers import HFConnector
    from kvtier.pd.sender import PDSender, chunks_from_kv
    from kvtier.service import Service

    model = _model(args)
    layout = layout_from_model(model)
    config = _config(args, "sender", layout.chunk_bytes(args.chunk_size), port)
    with Service(config, layout, model_name=f"llama-{args.model_size}") as service:
        engine = service.engine
        connector = HFConnector(engine, model)
        with PDSender.from_config(config, layout, engine.fingerprint.hex()) as sender:
            while (job := jobs.get()) is not None:
                rid, prompt = job
                pre = connector.prefill(prompt, request_id=rid)
                n = len(pre.tokens)
                kv = kv_from_cache(pre.cache, layout, n)
                spans = engine.keychain.keys(pre.tokens, include_partial=True)
                try:
                    report = sender.send(rid, chunks_from_kv(spans, kv))
                    moving = report.seconds - report.alloc_s
                    results.put(Sent(rid, report.sent, report.held, report.nbytes, moving))
                except TransferError as exc:
                    results.put(Sent(rid, 0, 0, 0, 0.0, f"{type(exc).__name__}: {exc}"))
                connector.store(pre)


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    systems = [[rng.randrange(vocab) for _ in range(args.system_tokens)] for _ in range(4)]
    prompts = []
    for i in range(args.requests):
        if i % 20 == 19:  # larger than the whole buffer: the decoder prefills it locally
            length = int(args.buffer_chunks + 4) * args.chunk_size
            prompts.append([rng.randrange(vocab) for _ in range(length)])
            continue
        user = [rng.randrange(vocab) for _ in range(rng.randrange(5, 3 * args.chunk_size))]
        prompts.append(systems[(i // 5) % 4] + user)  # neighbours share: the decoder holds it
    return prompts


def run(args: argparse.Namespace) -> int:
    from kvtier.demo.tiny_models import SIZES

    prompts = _prompts(args, SIZES[args.model_size].vocab)
    to_decoder, to_prefiller = SPAWN.Queue(), SPAWN.Queue()
    from_decoder, from_prefiller = SPAWN.Queue(), SPAWN.Queue()
    procs: list[multiprocessing.process.BaseProcess] = []
    start = time.perf_counter()
    try:
        decoder = SPAWN.Process(target=decoder_main, args=(args, to_decoder, from_decoder))
        procs.append(decoder)
        decoder.start()
        _, port, pages = from_decoder.get(timeout=300.0)
        prefiller = SPAWN.Process(
            target=prefiller_main, args=(args, port, to_prefiller, from_prefiller)
        )
        procs.append(prefiller)
        prefiller.start()
        print(f"decoder on 127.0.0.1:{port} ({args.channel}), receive buffer of {pages} chunks")
        for i, prompt in enumerate(prompts):
            to_prefiller.put((f"req-{i}", prompt))
            to_decoder.put((f"req-{i}", prompt))
        to_prefiller.put(None)
        to_decoder.put(None)
        sent = [from_prefiller.get(timeout=600.0) for _ in prompts]
        answers = [from_decoder.get(timeout=600.0) for _ in prompts]
        end = from_decoder.get(timeout=120.0)
        for proc in procs:
            proc.join(60.0)
    finally:
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.join(10.0)
    return _report(sent, answers, end, time.perf_counter() - start)


def _report(sent: list[Sent], answers: list[Answer], end: EndState, wall: float) -> int:
    moved = sum(s.nbytes for s in sent)
    seconds = sum(s.seconds for s in sent)
    transferred = sum(1 for a in answers if a.transferred)
    same = sum(1 for a in answers if a.same_as_local)
    print(f"requests: {len(answers)} in {wall:.1f}s; transferred {transferred}, ", end="")
    print(f"fell back to a local prefill {len(answers) - transferred}")
    print(f"chunks sent {sum(s.chunks for s in sent)}, ", end="")
    print(f"already held by the decoder (not sent again) {sum(s.held for s in sent)}")
    rate = moved / seconds / 1e6 if seconds else 0.0
    print(f"transfer: {moved / 1e6:.2f} MB in {seconds:.3f}s = {rate:.1f} MB/s (waits excluded)")
    reused, total = sum(a.reused_tokens for a in answers), sum(a.prompt_tokens for a in answers)
    print(f"decoder reused {reused} of {total} prompt tokens from the PD buffer")
    for s in [s for s in sent if s.error][:5]:
        print(f"  {s.request_id}: {s.error}")
    print(f"buffer occupancy (pages used of {end.num_pages} as each request starts):")
    print("  " + " ".join(str(a.pages_used) for a in answers))
    print(
        f"end state: {end.free_pages}/{end.num_pages} pages free, {end.leaks} leaked leases, ",
        end="",
    )
    print(f"invariants {end.problems or 'ok'}")
    print(f"answers identical to local generation: {same}/{len(answers)}")
    ok = same == len(answers) and end.free_pages == end.num_pages and not end.leaks
    ok = ok and not end.problems
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1
