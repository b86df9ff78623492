"""The `sluice-server` command.

    sluice-server serve MODEL_DIR --uds-path PATH [--dtype auto|float32|bfloat16|float16]
                  [--device cpu|cuda] [--kv-cache-bytes N] [--block-size 16]
                  [--kv-cache-dtype auto|float32|bfloat16] [--cpu-kernels auto|on|off]
                  [--expert-parallel]
                  [--cpu-block-rows N] [--max-weight-memory BYTES] [--num-threads N]
                  [--attention-backend auto|torch|triton] [--json-output]
                  [--max-loras N] [--max-lora-rank R] [--lora-root DIR ...]
                  [--lora-dtype auto|float32|bfloat16]
        Rank r (RANK, default 0) listens on unix://PATH-r and logs
        "Server started at unix://PATH-r" once it accepts calls.
        SIGTERM/SIGINT: stop, remove the socket, exit 0.

    sluice-server download-weights MODEL_ID [--revision REV] [--huggingface-hub-cache DIR]
        Resolves a Hub id, local folder or .gguf file to a local model folder
        and prints that folder as the last line of stdout.

    sluice-server download-adapter ORG/NAME [--revision REV] [--huggingface-hub-cache DIR]
        Fetches a LoRA adapter (adapter_config.json, adapter_model.safetensors)
        from the Hub, or finds it in the cache with HF_HUB_OFFLINE=1, and prints
        its snapshot folder as the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

from sluice_server import telemetry
from sluice_server.options import CPU_KERNEL_MODES, KV_CACHE_DTYPES, LORA_DTYPES, ShardOptions

log = logging.getLogger("sluice_server")

MAX_MESSAGE_BYTES = 256 * 2**20


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "target": record.name,
            "message": record.getMessage(),
        }
        rank = os.environ.get("RANK")
        if rank is not None:
            entry["rank"] = rank
        trace_id = telemetry.current_trace_id()
        if trace_id is not None:
            entry["trace_id"] = trace_id
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(json_output: bool, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_output:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def socket_path(uds_path: str, rank: int) -> str:
    """Rank r's socket file (TGI's convention: PATH-r)."""
    return f"{uds_path}-{rank}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="sluice-server", description="Sluice model shard")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve a model folder over gRPC on a unix socket")
    serve.add_argument("model_dir", type=Path)
    serve.add_argument("--uds-path", required=True, help="socket path prefix; rank r listens on PATH-r")
    serve.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    serve.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    serve.add_argument("--kv-cache-bytes", type=int, default=None,
                       help="KV cache size on CPU (default: 30%% of available RAM at warmup)")
    serve.add_argument("--block-size", type=int, default=16)
    serve.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                       help="KV cache element type; auto: bfloat16 on the CPU fast path (--dtype auto on a "
                            "GGUF's int8 blocks), else the model's dtype. Others: CPU only")
    serve.add_argument("--cpu-kernels", default="auto", choices=CPU_KERNEL_MODES,
                       help="the C++ CPU kernels: auto uses them where they build, on fails to start "
                            "without them, off serves on plain torch")
    serve.add_argument("--cpu-block-rows", type=int, default=None, metavar="N",
                       help="CPU matmuls of at most N rows run on a GGUF's blocks (0: never); "
                            "default: from the CPU's features")
    serve.add_argument("--max-weight-memory", type=int, default=None, metavar="BYTES",
                       help="bytes this shard's weights may take, every form counted; the dense copies of a "
                            "GGUF's block-served matrices are dropped to fit (every step then runs on the "
                            "blocks), and the shard refuses to start where the weights exceed it even so")
    serve.add_argument("--expert-parallel", action="store_true",
                       help="mixtures of experts over several shards: each shard holds num_experts / N whole "
                            "experts (the count must divide) instead of a slice of every expert")
    serve.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"],
                       help="auto: triton on CUDA, torch on CPU (triton on CPU needs TRITON_INTERPRET=1)")
    serve.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    serve.add_argument("--max-loras", type=int, default=0,
                       help="LoRA adapter slots, allocated at warmup (0: adapters off)")
    serve.add_argument("--max-lora-rank", type=int, default=64, help="the highest rank an adapter may have")
    serve.add_argument("--lora-root", action="append", default=[], type=Path,
                       help="a folder adapters may be loaded from (repeat for several)")
    serve.add_argument("--lora-dtype", default="auto", choices=LORA_DTYPES,
                       help="LoRA adapter stacks' element type; auto: bfloat16 on the CPU fast path (--dtype auto "
                            "on a GGUF's int8 blocks), else float32 on CPU and the model's dtype on CUDA")
    serve.add_argument("--json-output", action="store_true")
    serve.add_argument("--otlp-endpoint", default=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"),
                       help="OTLP/gRPC collector for traces (tracing is off when unset)")
    serve.add_argument("--otlp-service-name", default=os.environ.get("OTEL_SERVICE_NAME", "sluice-shard"))
    serve.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"))

    dl = sub.add_parser("download-weights", help="resolve a model and print its local folder")
    dl.add_argument("model_id")
    add_download_flags(dl)
    adapter = sub.add_parser("download-adapter", help="fetch a LoRA adapter from the Hub and print its local folder")
    adapter.add_argument("repo_id", metavar="ORG/NAME")
    add_download_flags(adapter)
    return parser.parse_args(argv)


def add_download_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--revision", default=None)
    parser.add_argument("--huggingface-hub-cache", default=None)
    parser.add_argument("--json-output", action="store_true")
    parser.add_argument("--log-level", default=os.environ.get("LOG_LEVEL", "info"))


async def serve(args: argparse.Namespace) -> int:
    import grpc
    import torch

    from sluice_server import faults
    from sluice_server.distributed import Distributed, init_distributed
    from sluice_server.model_runner import ModelRunner
    from sluice_server.pb import shard_pb2_grpc
    from sluice_server.servicer import ModelThread, Shard, ShardServicer

    if args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0, got {args.block_size}")
    options = ShardOptions(
        kv_cache_dtype=args.kv_cache_dtype, cpu_kernels=args.cpu_kernels, cpu_block_rows=args.cpu_block_rows,
        expert_parallel=args.expert_parallel, lora_dtype=args.lora_dtype, max_weight_memory=args.max_weight_memory,
    )
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda: no CUDA device is available")
    # All torch work, from the process group and the load on, runs on this
    # one thread (servicer.ModelThread says why).
    model_thread = ModelThread(args.num_threads)

    def load() -> tuple[Distributed, ModelRunner]:
        dist = init_distributed(device)
        started = time.perf_counter()
        runner = ModelRunner(
            args.model_dir, dtype=args.dtype, device=args.device, block_size=args.block_size, dist=dist,
            attention_backend=args.attention_backend, options=options, max_loras=args.max_loras,
            max_lora_rank=args.max_lora_rank, lora_roots=args.lora_root,
        )
        log.info(
            "loaded %s (%s, %s) in %.1fs, %d CPU threads; KV cache %s, CPU kernels %s, weights %.1f MiB "
            "(%.1f MiB of dense copies)",
            args.model_dir, runner.model_type, str(runner.dtype).removeprefix("torch."),
            time.perf_counter() - started, torch.get_num_threads(), str(runner.kv_dtype).removeprefix("torch."),
            runner.cpu_kernels_isa, runner.weight_bytes / 2**20, runner.dense_copy_bytes / 2**20,
        )
        return dist, runner

    dist, runner = await model_thread.run(load)
    injected = faults.from_env(dist.rank)
    telemetry.setup(args.otlp_endpoint, args.otlp_service_name, dist.rank)
    # Everything allocated so far (the model's modules, parameters, imported
    # code) lives as long as the process: keep it out of the cyclic garbage
    # collector's passes, which otherwise walk it all on every full
    # collection (measured: 9% of a one-sequence decode step on CPU).
    gc.collect()
    gc.freeze()

    urls = [f"unix://{socket_path(args.uds_path, r)}" for r in range(dist.world_size)]
    path = socket_path(args.uds_path, dist.rank)
    if os.path.exists(path):
        os.unlink(path)  # a stale socket from a killed run
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ])
    stop = asyncio.Event()
    fatal: list[str] = []

    def on_fatal(reason: str) -> None:
        fatal.append(reason)
        stop.set()

    servicer = ShardServicer(Shard(runner, urls, args.kv_cache_bytes, injected), fatal=on_fatal, model_thread=model_thread)
    shard_pb2_grpc.add_ShardServicer_to_server(servicer, server)
    with private_umask():
        server.add_insecure_port(f"unix://{path}")
        await server.start()
    os.chmod(path, 0o600)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("Server started at unix://%s", path)
    await stop.wait()
    if fatal:
        # Crash-only: this rank's collectives may be out of step with the
        # others', and a worker thread may still wait in one, so nothing is
        # drained or joined. The launcher sees the exit and stops the group.
        log.error("stopping the shard: %s", fatal[0])
        await server.stop(grace=None)
        telemetry.shutdown()
        _remove(path)
        logging.shutdown()
        os._exit(1)
    log.info("shutting down")
    await server.stop(grace=1.0)
    telemetry.shutdown()
    _remove(path)
    return 0


@contextlib.contextmanager
def private_umask():
    """Files created inside (the socket) are this user's alone, from the
    moment they exist: a local user who can connect to a shard can drive it."""
    previous = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(previous)


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.unlink(path)


def download_weights(args: argparse.Namespace) -> int:
    from sluice_server.download import resolve_model

    # The launcher stops us with SIGTERM: unwind like Ctrl-C, so that a
    # half-written conversion folder (gigabytes) is removed on the way out.
    signal.signal(signal.SIGTERM, _interrupt)
    folder = resolve_model(args.model_id, revision=args.revision, cache_dir=args.huggingface_hub_cache)
    print(folder, flush=True)
    return 0


def download_adapter(args: argparse.Namespace) -> int:
    from sluice_server.download import resolve_adapter

    signal.signal(signal.SIGTERM, _interrupt)
    folder = resolve_adapter(args.repo_id, revision=args.revision, cache_dir=args.huggingface_hub_cache)
    print(folder, flush=True)
    return 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.json_output, args.log_level)
    try:
        if args.command == "serve":
            return asyncio.run(serve(args))
        if args.command == "download-adapter":
            return download_adapter(args)
        return download_weights(args)
    except KeyboardInterrupt as e:
        log.info("%s interrupted (%s)", args.command, e or "SIGINT")
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line for the launcher, then exit 1
        log.error("%s failed: %s: %s", args.command, type(e).__name__, e, exc_info=log.isEnabledFor(logging.DEBUG))
        return 1


if __name__ == "__main__":
    sys.exit(main())
