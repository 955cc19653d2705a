"""The ``conversation`` workload of ``python -m benchmarks serve``: chats whose next prompt
holds the answer the model really generated.

vLLM's serving benchmark sends prompts fixed before the run, so its ``chat`` workload writes
each answer as random tokens. Here every round's prompt is the previous round's prompt, the
answer vLLM streamed back for it (token ids, ``return_token_ids``) and a new question, all
token ids (no tokenizer round trip)::

    user u, round 0   system + q(u,0)                                      all users share system
    user u, round r   prompt(u, r-1) + answer(u, r-1) + q(u, r)            answer: --answer-tokens,
                                                                           greedy, ignore_eos

Rounds go round by round over the users, one request at a time, so a time to first token is
a prefill (or a load) and never a wait in vLLM's queue. A cache serves round r from what
round r-1 left: the prompt (any cache) and the answer (vLLM's own prefix cache; kvtier with
``save_decode_cache``). The workload runs once per configuration (pass 1): a second pass of
the same conversation would only repeat the prefix workload.

:func:`run` returns the fields of vLLM's serving-benchmark result that ``bench serve`` keeps
(TTFT and end-to-end latency in ms over the rounds after the first, request and output
throughput over the whole run, and ``generated_texts``: each answer's token ids, to compare
configurations' outputs).
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from kvtier.errors import InputError

TIMEOUT_S = 1800.0


def questions(users: int, rounds: int, tokens: int, vocab: int) -> list[list[list[int]]]:
    """Seeded random questions, ``[user][round]``, of ids in ``[10, vocab)``."""
    if vocab <= 10:
        raise InputError(f"the model's vocabulary has {vocab} tokens; need more than 10")
    rng = random.Random(0)
    return [[rng.choices(range(10, vocab), k=tokens) for _ in range(rounds)] for _ in range(users)]


def run(url: str, model: str, args: Any, vocab: int) -> dict[str, Any]:
    """One whole conversation workload against vLLM's OpenAI server at ``url``."""
    users, rounds = int(args.users), int(args.rounds)
    if users < 1 or rounds < 2:
        raise InputError(f"conversation: --users {users}, --rounds {rounds}; use 1+ and 2+")
    asked = questions(users, rounds, int(args.question_tokens), vocab)
    system = random.Random(1).choices(range(10, vocab), k=int(args.system_tokens))
    prompts = [system + asked[u][0] for u in range(users)]
    ttft: list[float] = []
    e2el: list[float] = []
    answers: list[str] = []
    failed = 0
    started = time.perf_counter()
    for r in range(rounds):
        for u in range(users):
            try:
                first, total, answer = complete(url, model, prompts[u], int(args.answer_tokens))
            except (OSError, ValueError) as exc:
                raise RuntimeError(f"conversation: user {u}, round {r}: {exc}") from exc
            if len(answer) != int(args.answer_tokens):
                failed += 1
            if r:  # round 0 has nothing of this user's to reuse: not what this measures
                ttft.append(first)
                e2el.append(total)
            answers.append(" ".join(map(str, answer)))
            if r + 1 < rounds:
                prompts[u] = prompts[u] + answer + asked[u][r + 1]
    duration = time.perf_counter() - started
    return {
        **_stats("ttft", ttft),
        **_stats("e2el", e2el),
        "request_throughput": len(answers) / duration,
        "output_throughput": len(answers) * int(args.answer_tokens) / duration,
        "completed": len(answers) - failed,
        "failed": failed,
        "generated_texts": answers,
    }


def complete(
    url: str, model: str, prompt: list[int], max_tokens: int
) -> tuple[float, float, list[int]]:
    """(ms to the first token, ms to the last, the generated token ids) of one streamed,
    greedy completion of ``prompt``."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        for event in _events(response):
            ids = [int(t) for c in event.get("choices", ()) for t in c.get("token_ids") or ()]
            if ids and first is None:
                first = time.perf_counter()
            tokens += ids
    end = time.perf_counter()
    if first is None:
        raise ValueError("the server streamed no token")
    return (first - start) * 1e3, (end - start) * 1e3, tokens


def _events(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, up to ``data: [DONE]``."""
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line.removeprefix("data:").strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {
        f"mean_{name}_ms": statistics.fmean(values),
        f"median_{name}_ms": statistics.median(values),
        f"p99_{name}_ms": p99,
    }
