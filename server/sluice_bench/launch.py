"""A Sluice server for the length of a benchmark script's run.

The scripts under benchmarks/ compare runs of `sluice-launcher` with
different flags; each one starts it in its own process group (so stopping
it reaches the router and the shards too), waits for GET /ready, and stops
it however the run ends:

    with launched(default_launcher(), ["--speculate", "ngram"], ready_timeout=900) as url:
        ...  # url is http://127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx


def default_launcher() -> str:
    """$SLUICE_LAUNCHER_BIN, else the launcher beside this Python, else PATH's."""
    if os.environ.get("SLUICE_LAUNCHER_BIN"):
        return os.environ["SLUICE_LAUNCHER_BIN"]
    beside = Path(sys.executable).parent / "sluice-launcher"
    return str(beside) if beside.exists() else "sluice-launcher"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    """Until `url`/ready answers 200; an error if `proc` exits first or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the launcher exited with code {proc.returncode} before it was ready")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/ready", timeout=2.0).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{url}/ready did not answer 200 within {timeout:.0f}s")


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM to the process group, SIGKILL after `grace` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def launched(launcher: str, args: Sequence[str], ready_timeout: float, port: int | None = None,
             shown: int | None = None) -> Iterator[str]:
    """`launcher --port PORT *args` until the block ends; yields its base URL.
    `shown`: print only the first so many words of the command."""
    port = port or free_port()
    cmd = [launcher, "--port", str(port), *args]
    words = cmd if shown is None or len(cmd) <= shown else [*cmd[:shown], "..."]
    print(f"starting: {' '.join(words)}", flush=True)
    proc = subprocess.Popen(cmd, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, ready_timeout)
        yield url
    finally:
        stop(proc)
