"""sluice-bench: a load generator for any OpenAI-compatible server.

A benchmark goes through the modules in this order:

1. `workloads` - builds the plan before the clock starts: sessions of turns with
                 prompts of exact token lengths (random, shared-prefix,
                 multi-turn), deterministic for a seed.
2. `runner`    - sends the plan under a load shape (fixed concurrency or
                 Poisson arrivals), streams every response and records when
                 each token-carrying chunk arrived.
3. `metrics`   - turns those records into vLLM-compatible numbers: TTFT, TPOT,
                 ITL, E2E latency, throughput, goodput, $ per million tokens.
4. `report`    - terminal tables (single and side by side) and the JSON file.
5. `plot`      - PNG charts across a concurrency sweep (matplotlib, optional).

`cli` is the `sluice-bench` command. From Python:

    from sluice_bench import BenchConfig, WorkloadSpec, run_benchmark_sync
    result = run_benchmark_sync(BenchConfig(base_url="http://localhost:8080",
                                            spec=WorkloadSpec(kind="random"), concurrency=8))
    result.summary["output_throughput"]
"""

from .metrics import RequestRecord, summarize
from .runner import BenchConfig, RunResult, run_benchmark, run_benchmark_sync
from .workloads import LocalTokenizer, Plan, WorkloadSpec, build_plan

__all__ = [
    "BenchConfig",
    "LocalTokenizer",
    "Plan",
    "RequestRecord",
    "RunResult",
    "WorkloadSpec",
    "build_plan",
    "run_benchmark",
    "run_benchmark_sync",
    "summarize",
]
