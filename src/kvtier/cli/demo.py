"""``kvtier demo``: a multi-round chat workload, TTFT with and without kvtier.

Runs the workload of :mod:`kvtier.demo.workload` on a small Llama-style model built in code
(or a local Hugging Face checkpoint), prints the table, checks that every configuration
produced the same tokens (exit 1 if not) and writes a PNG of TTFT per round.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from typing import TYPE_CHECKING, Any

from kvtier.demo.tiny_models import SIZES
from kvtier.demo.workload import Workload
from kvtier.engine import Engine
from kvtier.errors import InputError
from kvtier.layout import dtype_from_name

if TYPE_CHECKING:
    from kvtier.demo.runner import DemoResult


def add_parser(parser: argparse.ArgumentParser) -> None:
    d = Workload()
    add = parser.add_argument
    add(
        "--engine",
        choices=("transformers", "vllm"),
        default="transformers",
        help="run the model in kvtier's transformers loop or in a real vLLM (kvtier[vllm]); "
        "vLLM: one fresh vLLM per configuration, the tiny checkpoint unless --model-dir",
    )
    add("--model-size", choices=sorted(SIZES), default="small", help="model built in code")
    add(
        "--model-dir", help="a local Hugging Face checkpoint (Llama/Mistral/Qwen2); never downloads"
    )
    add(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the model's and the KV's dtype (default: %(default)s)",
    )
    add("--users", type=int, default=d.users, help="conversations, each with its own context")
    add("--rounds", type=int, default=d.rounds, help="question-and-answer turns per user")
    add("--system-tokens", type=int, default=d.system_tokens, help="shared system prompt")
    add("--context-tokens", type=int, default=d.context_tokens, help="each user's own context")
    add("--question-tokens", type=int, default=d.question_tokens, help="each new question")
    add("--answer-tokens", type=int, default=d.answer_tokens, help="tokens generated per round")
    add("--chunk-size", type=int, default=256, help="kvtier's tokens per KV chunk")
    add("--seed", type=int, default=0, help="seed of the prompts and the model's weights")
    add("--disk-dir", help="disk tier directory (default: a temporary one, removed afterwards)")
    add("--plot", default="kvtier-demo.png", help="where to write the PNG (default: %(default)s)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--dashboard", action="store_true", help="serve the admin dashboard while it runs")
    add("--dashboard-port", type=int, default=8089, help="the dashboard's port on 127.0.0.1")


def run(args: argparse.Namespace) -> int:
    from kvtier.demo.runner import Options, run_demo

    workload = Workload(
        users=args.users,
        rounds=args.rounds,
        system_tokens=args.system_tokens,
        context_tokens=args.context_tokens,
        question_tokens=args.question_tokens,
        answer_tokens=args.answer_tokens,
        seed=args.seed,
    )
    if args.engine == "vllm":
        return _run_vllm(args, workload)
    options = Options(
        workload=workload,
        model_size=args.model_size,
        model_dir=args.model_dir,
        dtype=dtype_from_name(args.dtype),
        chunk_size=args.chunk_size,
        disk_dir=args.disk_dir,
        progress=not args.no_progress,
        seed=args.seed,
    )
    dashboard = _Dashboard(args.dashboard_port) if args.dashboard else None
    started = time.perf_counter()
    try:
        result = run_demo(options, on_engine=dashboard.attach if dashboard else None)
    finally:
        if dashboard is not None:
            dashboard.close()
    return _report(result, args.plot, started)


def _run_vllm(args: argparse.Namespace, workload: Workload) -> int:
    from kvtier.demo.vllm_runner import VllmOptions, run_vllm_demo

    if args.dashboard:
        # The Engine lives in vLLM's worker process, out of this process's reach.
        raise InputError(
            "--dashboard works with --engine transformers only; with vLLM, turn on the admin "
            "API in the connector's config (internal_api_server_enabled)"
        )
    options = VllmOptions(
        workload=workload,
        model_dir=args.model_dir,
        dtype=args.dtype,
        chunk_size=args.chunk_size,
        disk_dir=args.disk_dir,
        progress=not args.no_progress,
        seed=args.seed,
    )
    started = time.perf_counter()
    return _report(run_vllm_demo(options), args.plot, started)


def _report(result: DemoResult, plot: str, started: float) -> int:
    """Print the table, write the plot; 1 if any configuration's tokens differ."""
    from kvtier.demo.plot import write_plot
    from kvtier.demo.report import format_table, summary

    print(summary(result))
    print()
    print(format_table(result))
    for note in result.notes:
        print(f"note: {note}")
    write_plot(result, plot)
    print(f"\nplot: {plot}   total time: {time.perf_counter() - started:.0f} s")
    mismatches = result.mismatches()
    if mismatches:
        print(
            f"FAILED: {len(mismatches)} requests produced different tokens than without kvtier: "
            + ", ".join(mismatches[:10]),
            file=sys.stderr,
        )
        return 1
    print("tokens: identical in every configuration")
    if result.problems():
        print("FAILED: " + "; ".join(result.problems()), file=sys.stderr)
        return 1
    print("leases: none left open; reference counts consistent")
    return 0


class _Dashboard:
    """One admin server at a time, moved to each engine the demo opens."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.server: Any = None
        self.available = importlib.util.find_spec("kvtier.admin") is not None
        if not self.available:
            print("dashboard unavailable: kvtier.admin is not part of this build", file=sys.stderr)

    def attach(self, engine: Engine) -> None:
        if not self.available:
            return
        from kvtier.admin.server import AdminServer

        self.close()
        try:
            self.server = AdminServer(engine, port=self.port).open()
        except OSError as exc:
            print(f"dashboard not started on port {self.port}: {exc}", file=sys.stderr)
            return
        print(f"dashboard: {self.server.url}", file=sys.stderr)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
