"""The Kubernetes pod's contract, without a cluster, and the gauges the
Gateway API Inference Extension's endpoint picker reads.

`test_pod_contract` renders the Helm chart (deploy/helm/sluice), runs the
launcher exactly as its container spec says (args, env with the Secret's
value, port), and plays the kubelet: the startup probe until it passes, then
readiness and liveness; traffic; then a pod deletion with a stream in flight:
the preStop hook, SIGTERM, and the stream must finish, with the launcher
gone, inside terminationGracePeriodSeconds.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import Launcher, find_executable, free_port, start_launcher

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "deploy" / "tests"))
from chart import render, sluice_container  # noqa: E402

API_KEY = "pod-contract-key"


def promtool() -> str:
    found = shutil.which("promtool")
    if not found:
        pytest.fail("promtool is missing: `apt-get install -y prometheus` (scripts/test.sh does it)")
    return found


def scrape(base_url: str) -> tuple[str, dict[str, float]]:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return text, samples


def image_env() -> dict[str, str]:
    """The Dockerfile's runtime ENV (PATH aside): the container starts with it."""
    text = (ROOT / "Dockerfile").read_text()
    block = text[text.rindex("\nENV ") + 5:].split("\n\n")[0].split("\nCOPY")[0]
    pairs = re.findall(r"([A-Z_]+)=(\S+)", block.replace("\\\n", " "))
    return {k: v for k, v in pairs if k != "PATH"}


def torch_extensions_dir() -> Path:
    """Where torch builds extensions when TORCH_EXTENSIONS_DIR is unset."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    device = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{device}"


@dataclass
class HttpProbe:
    """A container's httpGet probe, as the kubelet runs it."""

    port: int
    path: str
    period: float
    timeout: float
    failure_threshold: int
    success_threshold: int = 1

    @classmethod
    def of(cls, spec: dict, ports: dict[str, int]) -> "HttpProbe":
        port = spec["httpGet"]["port"]
        return cls(port=ports[port] if isinstance(port, str) else port, path=spec["httpGet"]["path"],
                   period=spec.get("periodSeconds", 10), timeout=spec.get("timeoutSeconds", 1),
                   failure_threshold=spec.get("failureThreshold", 3),
                   success_threshold=spec.get("successThreshold", 1))

    def once(self) -> bool:
        # The kubelet: any status in [200, 400) within the timeout passes.
        try:
            status = httpx.get(f"http://127.0.0.1:{self.port}{self.path}", timeout=self.timeout).status_code
        except httpx.HTTPError:
            return False
        return 200 <= status < 400


def run_startup_probe(probe: HttpProbe, proc: subprocess.Popen, output) -> None:
    failures = 0
    while not probe.once():
        assert proc.poll() is None, f"the container exited ({proc.returncode}):\n{output()}"
        failures += 1
        if failures >= probe.failure_threshold:
            pytest.fail(f"startup probe failed {failures} times: the kubelet restarts the container\n{output()}")
        time.sleep(probe.period)


def wait_ready(probe: HttpProbe) -> None:
    successes, deadline = 0, time.monotonic() + 60
    while successes < probe.success_threshold:
        assert time.monotonic() < deadline, "readiness never passed after startup"
        successes = successes + 1 if probe.once() else 0
        if successes < probe.success_threshold:
            time.sleep(probe.period)


def resolved_env(objects: list[dict], container: dict) -> dict[str, str]:
    secrets = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "Secret"}
    env = {}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
    return env


def stream_completion(base_url: str, model: str, max_tokens: int, chunks: list, done: threading.Event) -> None:
    body = {"model": model, "prompt": "The river", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    try:
        with httpx.stream("POST", f"{base_url}/v1/completions", json=body, headers=headers, timeout=300) as resp:
            chunks.append(resp.status_code)
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
    finally:
        done.set()


def test_pod_contract(tiny_model_dir, tmp_path):
    port = free_port()
    data = tmp_path / "data"  # the cache volume's mount
    data.mkdir()
    # The chart puts the CPU kernels' builds on the cache volume; here that
    # folder is the one the other tests' shards built them in.
    built = torch_extensions_dir()
    built.mkdir(parents=True, exist_ok=True)
    (data / "torch_extensions").symlink_to(built)
    objects = render("cpu", {
        "launcher.model-id": str(tiny_model_dir),
        "launcher.kv-cache-bytes": 64 * 1024 * 1024,
        "launcher.max-batch-prefill-tokens": 512,
        # The drain bound (and with it the grace period): the 1,500-token
        # stream below must end inside it however busy the machine is.
        "launcher.shutdown-timeout": 300,
        # One token per step: the stream must outlast the preStop sleep and
        # the readiness checks; multi-step decode would draw the tiny
        # model's 1,500 tokens in about a second.
        "launcher.decode-steps": 1,
        # Pods have their own /tmp and network namespace; tests share the host's.
        "launcher.shard-uds-path": str(tmp_path / "shard"),
        "launcher.master-port": free_port(),
        "server.hostname": "127.0.0.1",
        "server.port": port,
        "cache.mountPath": str(data),
        "apiKey.value": API_KEY,
        "termination.preStopSleepSeconds": 3,
        # Probe the start every 2 s (the chart's 10 s would only slow the test).
        "probes.startup.periodSeconds": 2,
        "probes.startup.failureThreshold": 300,
    })
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = sluice_container(objects)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    startup, liveness, readiness = (HttpProbe.of(container[k], ports)
                                    for k in ("startupProbe", "livenessProbe", "readinessProbe"))
    # Only on this machine's loopback (the args override the image's 0.0.0.0).
    assert "--hostname=127.0.0.1" in container["args"] and f"--port={port}" in container["args"]
    env = {**os.environ, **image_env(), **resolved_env(objects, container)}
    assert env["API_KEY"] == API_KEY and "--api-key" not in " ".join(container["args"])

    # The image's entrypoint is sluice-launcher; the container's args follow it.
    proc = subprocess.Popen([find_executable("sluice-launcher"), *container["args"]], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    server = Launcher(proc=proc, base_url=f"http://127.0.0.1:{ports['http']}", port=ports["http"], uds_path="")
    threading.Thread(target=lambda: [server.lines.append(l.rstrip("\n")) for l in proc.stdout], daemon=True).start()
    try:
        # 1. Startup, then readiness and liveness.
        run_startup_probe(startup, proc, server.output)
        wait_ready(readiness)
        assert liveness.once()

        # 2. Traffic: the key from the Secret guards the API, not the probes or /metrics.
        model = httpx.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"},
                          timeout=10).json()["data"][0]["id"]
        chat = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        assert httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60).status_code == 401
        ok = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60,
                        headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200, ok.text
        text, samples = scrape(server.base_url)
        check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert samples["sluice_kv_cache_usage_ratio"] == 0 and samples["sluice_queue_size"] == 0

        # 3. A stream in flight when the pod is deleted.
        chunks: list = []
        done = threading.Event()
        threading.Thread(target=stream_completion, args=(server.base_url, model, 1500, chunks, done),
                         daemon=True).start()
        deadline = time.monotonic() + 60
        while len(chunks) < 4 and not done.is_set():
            assert time.monotonic() < deadline, "the stream did not start"
            time.sleep(0.05)
        assert chunks[0] == 200
        assert scrape(server.base_url)[1]["sluice_kv_cache_usage_ratio"] > 0

        # The kubelet runs preStop (sleep) first: the endpoint is being
        # removed and requests still arriving are served.
        deleted = time.monotonic()
        grace = pod["terminationGracePeriodSeconds"]
        pre_stop_end = deleted + container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert readiness.once()
        late = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
        assert late.status_code == 200, late.text
        time.sleep(max(0.0, pre_stop_end - time.monotonic()))
        assert not done.is_set(), "the stream ended before SIGTERM: give it more tokens"

        # Then SIGTERM to the container's main process.
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while readiness.once():
            assert time.monotonic() < deadline, "still ready while draining"
            time.sleep(0.2)
        assert liveness.once(), "liveness fails while draining: the kubelet would kill the drain"
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60,
                             headers={"Authorization": f"Bearer {API_KEY}"})
        assert refused.status_code == 503

        assert done.wait(timeout=max(0.0, deleted + grace - time.monotonic())), "stream still open at the grace period"
        assert chunks[-1] == "[DONE]"
        usage = [json.loads(c)["usage"] for c in chunks[1:-1] if json.loads(c).get("usage")]
        assert usage and usage[-1]["completion_tokens"] == 1500
        try:
            code = proc.wait(timeout=max(0.0, deleted + grace - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher outlived terminationGracePeriodSeconds ({grace}s): SIGKILL\n{server.output()}")
        assert code == 0, server.output()
    finally:
        server.stop()


def test_picker_gauges_move(tiny_model_dir, tmp_path):
    """sluice_queue_size grows while requests wait for a batch slot, and
    sluice_kv_cache_usage_ratio (in [0, 1]) grows as a request's blocks fill."""
    # One request per step, a KV cache of 128 blocks of 16 tokens (the tiny
    # model stores 512 bytes per token): a 1000-token request takes half.
    # One token per step (--decode-steps 1): the 50 ms samples below must
    # catch the long request's last blocks, which multi-step decode would
    # fill several tokens a step on the tiny model.
    server = start_launcher("--model-id", str(tiny_model_dir), "--max-batch-size", "1",
                            "--kv-cache-bytes", str(128 * 16 * 512), "--max-batch-prefill-tokens", "512",
                            "--decode-steps", "1", tmp=tmp_path)
    try:
        model = httpx.get(f"{server.base_url}/v1/models", timeout=10).json()["data"][0]["id"]
        _, idle = scrape(server.base_url)
        assert idle["sluice_kv_cache_usage_ratio"] == 0 and idle["sluice_queue_size"] == 0
        capacity = idle["sluice_kv_blocks_capacity"]
        streams = []
        for max_tokens in (1000, 40, 40, 40):
            chunks, done = [], threading.Event()
            body = {"model": model, "prompt": "The river", "max_tokens": max_tokens, "ignore_eos": True,
                    "stream": True}
            threading.Thread(target=lambda b=body, c=chunks, d=done: _stream(server, b, c, d), daemon=True).start()
            streams.append((chunks, done))
            # In order: the long one streams alone, each other one waits behind it.
            if len(streams) == 1:
                wait_until(lambda c=chunks: c, "the long stream's first token", server)
            else:
                waiting = len(streams) - 1
                wait_until(lambda n=waiting: scrape(server.base_url)[1]["sluice_queue_size"] == n,
                           f"{waiting} requests waiting", server)
        ratios, queued = [], []
        deadline = time.monotonic() + 240
        while not all(done.is_set() for _, done in streams):
            assert time.monotonic() < deadline, server.output()
            text, samples = scrape(server.base_url)
            ratios.append(samples["sluice_kv_cache_usage_ratio"])
            queued.append(samples["sluice_queue_size"])
            time.sleep(0.05)
        assert all(0 <= r <= 1 for r in ratios)
        # While the long request decodes alone, its blocks are the used ones.
        # It ends with 63 blocks; sampled every 50 ms, the peak is close to that.
        peak = ratios.index(max(ratios))
        assert ratios[peak] >= 50 / capacity, (ratios[peak], capacity)
        filling = [r for r in ratios[:peak + 1] if r > 0]
        assert filling[0] < ratios[peak] and filling == sorted(filling), filling
        assert max(queued) == 3
        for chunks, _ in streams:
            assert chunks and chunks[-1] == "[DONE]"
        text, samples = scrape(server.base_url)
        # Finished requests' blocks stay in the prefix cache: cached, not used.
        assert samples["sluice_kv_cache_usage_ratio"] == 0 and samples["sluice_queue_size"] == 0
        assert samples["sluice_kv_blocks_cached"] > 0
        check = subprocess.run([promtool(), "check", "metrics"], input=text, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "# TYPE sluice_kv_cache_usage_ratio gauge" in text
    finally:
        server.stop()


def wait_until(condition, what: str, server: Launcher, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}\n{server.output()}"
        time.sleep(0.05)


def _stream(server: Launcher, body: dict, chunks: list, done: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=240) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    chunks.append(line[len("data: "):])
    finally:
        done.set()
