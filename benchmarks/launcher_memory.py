"""Serves a model through the real launcher and prints each process's memory.

Starts `sluice-launcher` on --model (extra launcher flags after `--`), waits
until the router is ready, sends a few greedy /generate requests, and prints
VmRSS and VmHWM (the peak, loading included) of the launcher, the router
and each shard, read from /proc; then stops the launcher with SIGTERM.
For a GGUF too large to convert to float32 on the host (Llama-3-8B's shape,
benchmarks/README.md):

    python benchmarks/weight_memory.py --shape llama-8b --quant Q4_0 --write-only --out /tmp/wm
    python benchmarks/launcher_memory.py --model /tmp/wm/llama-8b-Q4_0.gguf -- \\
        --kv-cache-bytes 268435456 --max-total-tokens 256 --max-batch-prefill-tokens 32

`--tpot-tokens N` also times one request's decode (c=1 time per output
token, the prefill and round trip subtracted) against the time to read the
.gguf once at the host's copy bandwidth.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def status(pid: int) -> dict[str, int]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of every process below `pid`."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                continue
            out.append((child, cmd))
            todo.append(child)
    return out


def role(cmd: str) -> str | None:
    if "sluice-router" in cmd:
        return "router"
    if " serve " in f" {cmd} " and "sluice" in cmd:
        return "shard"
    return None


def generate_seconds(base: str, model: str, prompt: str, tokens: int) -> float:
    """Wall time of one greedy completion of exactly `tokens` tokens."""
    t0 = time.monotonic()
    r = httpx.post(f"{base}/v1/completions", timeout=3600, json={
        "model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    if r.json()["usage"]["completion_tokens"] != tokens:
        raise RuntimeError(f"asked for {tokens} tokens, got {r.json()['usage']}")
    return time.monotonic() - t0


def time_per_token(base: str, prompt: str, tokens: int, model: Path) -> None:
    """c=1 time per output token: (a request of 1 + tokens tokens less one of
    1 token) / tokens, each the best of two, so that the prompt's prefill and
    the round trip drop out; against the time to read the model file once at
    the host's copy bandwidth (a decode step reads every weight once)."""
    served = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    short = min(generate_seconds(base, served, prompt, 1) for _ in range(2))
    long = min(generate_seconds(base, served, prompt, 1 + tokens) for _ in range(2))
    tpot = (long - short) / tokens
    from step_bench import memory_bandwidth  # the copy bandwidth of moe_bench's and step_bench's floors

    bandwidth = memory_bandwidth()
    read = model.stat().st_size / (bandwidth * 1e9) if model.is_file() else float("nan")
    print(f"c=1 time per output token: {tpot * 1e3:.1f} ms ({tokens} tokens); weight-read time "
          f"{read * 1e3:.1f} ms (file {model.stat().st_size / 2**20:,.0f} MiB at {bandwidth:.1f} GB/s copy "
          f"bandwidth): {tpot / read:.2f}x", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800, help="seconds to wait for readiness")
    p.add_argument("--tpot-tokens", type=int, default=0,
                   help="also time one request's decode: N tokens (time per output token, c=1)")
    p.add_argument("flags", nargs="*", help="launcher flags (after --)")
    args = p.parse_args()

    launcher_exe = shutil.which("sluice-launcher")
    if launcher_exe is None:
        sys.exit("sluice-launcher is not on PATH (install Sluice: scripts/install.sh)")
    tmp = Path(tempfile.mkdtemp(prefix="launcher-memory-"))
    port = free_port()
    cmd = [launcher_exe, "--model-id", args.model, "--port", str(port), "--hostname", "127.0.0.1",
           "--shard-uds-path", str(tmp / "shard"), "--master-port", str(free_port()),
           "--data-dir", str(tmp / "data"), *args.flags]
    print("$ " + " ".join(cmd), flush=True)
    log = open(tmp / "launcher.log", "w")
    started = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if proc.poll() is not None:
                sys.exit(f"the launcher exited ({proc.returncode}):\n" + (tmp / "launcher.log").read_text()[-4000:])
            try:
                if httpx.get(f"{base}/ready", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > args.timeout:
                sys.exit("not ready in time:\n" + (tmp / "launcher.log").read_text()[-4000:])
            time.sleep(2)
        print(f"ready after {time.monotonic() - started:.0f} s", flush=True)
        info = httpx.get(f"{base}/info", timeout=30).json()
        print("info: " + ", ".join(f"{k}={info[k]}" for k in sorted(info) if k in (
            "model_id", "model_dtype", "cpu_matmuls", "weight_bytes", "dense_copy_bytes", "kv_cache_dtype",
            "max_total_tokens", "total_parameters")), flush=True)
        for i in range(args.requests):
            t0 = time.monotonic()
            r = httpx.post(f"{base}/generate", timeout=600, json={
                "inputs": args.prompt, "parameters": {"max_new_tokens": args.new_tokens, "do_sample": False}})
            r.raise_for_status()
            print(f"request {i}: {time.monotonic() - t0:.1f} s, {r.json()['generated_text']!r}", flush=True)
        if args.tpot_tokens:
            time_per_token(base, args.prompt, args.tpot_tokens, Path(args.model))
        rows = [("launcher", proc.pid)] + [(role(c), pid) for pid, c in descendants(proc.pid) if role(c)]
        print("| process | VmRSS | VmHWM (peak) |\n|---|---|---|")
        for name, pid in rows:
            s = status(pid)
            print(f"| {name} (pid {pid}) | {s['VmRSS'] / 2**20:,.0f} MiB | {s['VmHWM'] / 2**20:,.0f} MiB |", flush=True)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
        print(f"launcher log: {tmp / 'launcher.log'}")


if __name__ == "__main__":
    main()
