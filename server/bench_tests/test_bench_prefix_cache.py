"""benchmarks/prefix_cache.py end to end against a fake launcher: it starts the
server twice (caching on, then --no-prefix-caching), waits for /ready, runs the
identical workload on both, stops each server and reports the ratios."""

from __future__ import annotations

import importlib.util
import json
import os
import stat
import sys
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parent
SERVER = TESTS.parent
SCRIPT = SERVER.parent / "benchmarks" / "prefix_cache.py"

# Serves a fake OpenAI API on --port after a short start-up; "caching on" is
# simulated as a faster first token and cached tokens in usage.
FAKE_LAUNCHER = """#!{python}
import signal, sys, time
sys.path[:0] = {paths!r}
from _bench_fakes import FakeServer, byte_level_bpe
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
caching = "--no-prefix-caching" not in args
server = FakeServer(byte_level_bpe(), port=int(args[args.index("--port") + 1]),
                    ttft=0.005 if caching else 0.25, gap=0.001 if caching else 0.003,
                    cached_tokens=64 if caching else 0)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
time.sleep(0.5)  # not ready at once: the script must wait for /ready
with server:
    while True:
        time.sleep(0.1)
"""


def load_script():
    spec = importlib.util.spec_from_file_location("prefix_cache_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_launcher(tmp_path):
    log = tmp_path / "launches.log"
    exe = tmp_path / "fake-launcher"
    exe.write_text(FAKE_LAUNCHER.format(python=sys.executable, paths=[str(TESTS), str(SERVER)], log=str(log)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe, log


def test_on_then_off_with_identical_requests(fake_launcher, tmp_path, capsys):
    exe, log = fake_launcher
    from _bench_fakes import byte_level_bpe

    byte_level_bpe().save(str(tmp_path / "tokenizer.json"))
    from sluice_bench.launch import free_port

    port = free_port()
    out = tmp_path / "prefix.json"
    code = load_script().main([
        "--launcher", str(exe), "--port", str(port), "--launcher-arg=--max-batch-prefill-tokens=256",
        "--tokenizer", str(tmp_path), "--system-prompt-len", "64", "--question-len", "8", "--output-len", "8",
        "--num-prompts", "8", "--concurrency", "4", "--warmup", "1", "--ready-timeout", "60", "--out", str(out),
    ])
    text = capsys.readouterr().out
    assert code == 0
    launches = log.read_text().splitlines()
    assert launches == [f"--port {port} --max-batch-prefill-tokens=256",
                        f"--port {port} --max-batch-prefill-tokens=256 --no-prefix-caching"]
    doc = json.loads(out.read_text())
    on, off = (r["summary"] for r in doc["runs"])
    assert on["completed"] == off["completed"] == 8
    assert on["cached_prompt_tokens"] == 8 * 64 and off["cached_prompt_tokens"] == 0
    assert on["ttft_ms"]["median"] < off["ttft_ms"]["median"]
    # the verdict states the measured ratios and judges them against the goals
    tput = on["output_throughput"] / off["output_throughput"]
    ttft = off["ttft_ms"]["median"] / on["ttft_ms"]["median"]
    assert f"throughput on/off: x{tput:.2f} (goal >= 2.0: {'met' if tput >= 2 else 'NOT met'})" in text
    assert f"median TTFT off/on: x{ttft:.2f} (goal >= 4.0: {'met' if ttft >= 4 else 'NOT met'})" in text
    assert on["prompt_length_mismatches"]["checked"] == 8 and on["prompt_length_mismatches"]["mismatched"] == 0
    # both servers were stopped
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)


def test_a_launcher_that_dies_is_reported(capsys):
    code = load_script().main(["--launcher", "false", "--ready-timeout", "20"])
    assert code == 2
    assert "the launcher exited with code 1 before it was ready" in capsys.readouterr().err


def test_a_missing_launcher_is_reported(capsys):
    code = load_script().main(["--launcher", os.path.join("no", "such", "launcher")])
    assert code == 2 and "No such file" in capsys.readouterr().err


def test_urls_come_in_pairs():
    with pytest.raises(SystemExit):
        load_script().main(["--on-url", "http://127.0.0.1:1"])
