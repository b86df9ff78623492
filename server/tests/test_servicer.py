"""The shard as a real process: `python -m sluice_server.cli serve` on a unix
socket, driven through the generated gRPC stubs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import pytest
import torch

from sluice_server.pb import shard_pb2, shard_pb2_grpc

from conftest import CHECKOUT_PYTHONPATH, make_tiny_model

BLOCK = 4
# A shard's start may include building the CPU kernels for this checkout
# (minutes on a busy 2-core machine); only a hang should reach this.
START_TIMEOUT_S = 600
GREEDY = shard_pb2.SamplingParams()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("servicer-model"), "tied", seed=7)


@pytest.fixture(scope="module")
def server(model_dir):
    """(process, stub, socket path). Unix socket paths are limited to ~107
    bytes, so the socket lives in a short temporary folder."""
    sock_dir = tempfile.mkdtemp(prefix="sluice-")
    uds = os.path.join(sock_dir, "shard")
    log_path = os.path.join(sock_dir, "server.log")
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PYTHONPATH, RANK="0", WORLD_SIZE="1")
    cmd = [sys.executable, "-m", "sluice_server.cli", "serve", str(model_dir), "--uds-path", uds,
           "--kv-cache-bytes", str(64 * 2**20), "--block-size", str(BLOCK), "--num-threads", "1"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while "Server started at unix://" + uds + "-0" not in Path(log_path).read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("server did not start:\n" + Path(log_path).read_text())
        time.sleep(0.1)
    channel = grpc.insecure_channel(f"unix://{uds}-0")
    yield proc, shard_pb2_grpc.ShardStub(channel), uds
    channel.close()
    if proc.poll() is None:
        proc.kill()
    shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def stub(server):
    """A warmed-up shard. Before Warmup, Step must fail with FAILED_PRECONDITION."""
    _, stub, _ = server
    with pytest.raises(grpc.RpcError) as err:
        stub.Step(shard_pb2.StepRequest(new_requests=[new_request(1, [5, 6, 7], [0])]))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    warm = stub.Warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=64, max_batch_size=8, max_total_tokens=64))
    assert warm.num_blocks > 0 and warm.kv_cache_bytes > 0
    stub.num_blocks = warm.num_blocks
    return stub


def new_request(rid, tokens, blocks, num_new=None, computed=0, params=GREEDY):
    return shard_pb2.NewRequest(
        id=rid, token_ids=tokens, num_prompt_tokens=len(tokens), num_computed_tokens=computed,
        num_new_tokens=num_new if num_new is not None else len(tokens) - computed, block_ids=blocks, params=params,
    )


def hf_greedy(model_dir: Path, tokens: list[int], n: int) -> list[int]:
    from sluice_server.testing import transformers_model

    model = transformers_model(model_dir, dtype=torch.float32)
    out = model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, min_new_tokens=n)
    return out[0, len(tokens):].tolist()


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_info(server):
    _, stub, _ = server
    info = stub.Info(shard_pb2.InfoRequest())
    assert (info.model_type, info.dtype, info.device_type) == ("llama", "float32", "cpu")
    assert (info.world_size, info.rank, info.block_size, info.vocab_size) == (1, 0, BLOCK, 128)
    assert list(info.eos_token_ids) == [2]
    assert info.max_position_embeddings == 256 and info.attention_backend == "torch"
    # The tiny tied Llama: the embedding 128 x 64 (the LM head is the same
    # weight), per layer q/k/v/o 64 x (64 + 32 + 32 + 64), MLP 3 x 64 x 96,
    # two norms; the final norm.
    per_layer = 64 * 192 + 3 * 64 * 96 + 2 * 64
    assert info.total_parameters == 128 * 64 + 2 * per_layer + 64
    assert info.active_parameters == info.total_parameters  # dense


def test_discovery_and_health(server):
    _, stub, uds = server
    assert list(stub.ServiceDiscovery(shard_pb2.ServiceDiscoveryRequest()).urls) == [f"unix://{uds}-0"]
    stub.Health(shard_pb2.HealthRequest())


def test_prefill_chunks_and_decodes_are_greedy(stub, model_dir):
    a_tokens, b_tokens = [5, 9, 17, 33, 4, 81, 12], [40, 41, 42, 7, 99, 100, 3, 3, 8, 11]
    want_a, want_b = hf_greedy(model_dir, a_tokens, 6), hf_greedy(model_dir, b_tokens, 5)
    # Step 1: a whole, b's first chunk of 6 tokens (no token sampled for b).
    r = stub.Step(shard_pb2.StepRequest(new_requests=[
        new_request(1, a_tokens, [10, 3]),
        new_request(2, b_tokens, [7, 20], num_new=6, params=shard_pb2.SamplingParams(prompt_logprobs=True)),
    ]))
    assert [(g.id, g.token_id) for g in r.generations] == [(1, want_a[0])]
    # Step 2: a decodes (needs a third block for position 8), b finishes its prompt.
    r = stub.Step(shard_pb2.StepRequest(scheduled=[
        shard_pb2.ScheduledRequest(id=1, num_new_tokens=1, new_block_ids=[31]),
        shard_pb2.ScheduledRequest(id=2, num_new_tokens=4, new_block_ids=[4]),
    ]))
    got = {g.id: g for g in r.generations}
    assert got[1].token_id == want_a[1] and got[2].token_id == want_b[0]
    assert [p.token_id for p in got[2].prompt_logprobs] == b_tokens[1:]
    assert all(p.logprob < 0 for p in got[2].prompt_logprobs)
    assert r.timings.forward_ms > 0
    tokens = {1: want_a[:2], 2: want_b[:1]}
    for _ in range(3):
        r = stub.Step(shard_pb2.StepRequest(scheduled=[
            shard_pb2.ScheduledRequest(id=1, num_new_tokens=1),
            shard_pb2.ScheduledRequest(id=2, num_new_tokens=1, new_block_ids=[5] if len(tokens[2]) == 2 else []),
        ]))
        for g in r.generations:
            tokens[g.id].append(g.token_id)
    assert tokens[1] == want_a[:5] and tokens[2] == want_b[:4]
    stub.Step(shard_pb2.StepRequest(finished_ids=[1, 2]))


def test_malformed_steps_fail_and_server_keeps_serving(stub, model_dir):
    tokens = [5, 6, 7, 8, 9]
    want = hf_greedy(model_dir, tokens, 2)
    r = stub.Step(shard_pb2.StepRequest(new_requests=[new_request(50, tokens, [1, 2])]))
    assert r.generations[0].token_id == want[0]
    bad_steps = {
        "unknown id": shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=999, num_new_tokens=1)]),
        "block out of range": shard_pb2.StepRequest(new_requests=[new_request(51, [1, 2], [stub.num_blocks])]),
        "token out of vocab": shard_pb2.StepRequest(new_requests=[new_request(52, [1, 128], [0])]),
        "too few blocks": shard_pb2.StepRequest(new_requests=[new_request(53, [1, 2, 3, 4, 5], [0])]),
        "duplicate id": shard_pb2.StepRequest(new_requests=[new_request(50, [1, 2], [0])]),
        "past the tokens": shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=50, num_new_tokens=2)]),
        # Valid for 50, but the step as a whole is bad: 50 must not advance.
        "bad with good": shard_pb2.StepRequest(
            scheduled=[shard_pb2.ScheduledRequest(id=50, num_new_tokens=1)],
            new_requests=[new_request(54, [1, 2], [stub.num_blocks + 5])]),
    }
    for name, step in bad_steps.items():
        assert code_of(lambda: stub.Step(step)) == grpc.StatusCode.INVALID_ARGUMENT, name
    stub.Health(shard_pb2.HealthRequest())
    r = stub.Step(shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=50, num_new_tokens=1)]))
    assert [(g.id, g.token_id) for g in r.generations] == [(50, want[1])]
    stub.Step(shard_pb2.StepRequest(finished_ids=[50]))


def test_bad_parameter_fails_only_its_request(stub, model_dir):
    tokens = [12, 13, 14]
    bad = shard_pb2.SamplingParams(logit_bias=[shard_pb2.LogitBias(token_id=500, bias=1.0)])
    r = stub.Step(shard_pb2.StepRequest(new_requests=[
        new_request(60, tokens, [0]), new_request(61, tokens, [1], params=bad),
    ]))
    assert [g.id for g in r.generations] == [60]
    assert [e.id for e in r.errors] == [61] and "logit_bias" in r.errors[0].message
    assert r.generations[0].token_id == hf_greedy(model_dir, tokens, 1)[0]
    # 61 was never admitted: scheduling it is an unknown id.
    step = shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=61, num_new_tokens=1)])
    assert code_of(lambda: stub.Step(step)) == grpc.StatusCode.INVALID_ARGUMENT
    stub.Step(shard_pb2.StepRequest(finished_ids=[60]))


def test_cached_prefix_request(stub, model_dir):
    """A second request whose first block holds the first's KV computes only the rest."""
    tokens = [21, 22, 23, 24, 25, 26]
    want = hf_greedy(model_dir, tokens, 1)[0]
    r = stub.Step(shard_pb2.StepRequest(new_requests=[new_request(70, tokens, [8, 9])]))
    assert r.generations[0].token_id == want
    r = stub.Step(shard_pb2.StepRequest(finished_ids=[70], new_requests=[new_request(71, tokens, [8, 11], computed=4)]))
    assert r.generations[0].token_id == want
    stub.Step(shard_pb2.StepRequest(finished_ids=[71]))


def test_clear_cache_drops_requests(stub):
    stub.Step(shard_pb2.StepRequest(new_requests=[new_request(80, [1, 2, 3], [0])]))
    stub.ClearCache(shard_pb2.ClearCacheRequest())
    step = shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=80, num_new_tokens=1)])
    assert code_of(lambda: stub.Step(step)) == grpc.StatusCode.INVALID_ARGUMENT


def test_model_work_runs_on_one_thread(server, stub):
    """Load, warmup, steps and probes all run on the one model thread, with
    --num-threads applied there (servicer.ModelThread: a second thread doing
    torch work costs a 2-core host 4x per decode step)."""
    proc, stub, uds = server
    stub.Step(shard_pb2.StepRequest(new_requests=[new_request(90, [1, 2, 3], [0])]))
    stub.Health(shard_pb2.HealthRequest())
    stub.Step(shard_pb2.StepRequest(finished_ids=[90]))
    names = [Path(f"/proc/{proc.pid}/task/{t}/comm").read_text().strip() for t in os.listdir(f"/proc/{proc.pid}/task")]
    assert names.count("sluice-model") == 1, names
    log = (Path(uds).parent / "server.log").read_text()
    assert "1 CPU threads" in log, log


def test_socket_is_private(server):
    """Only this user may connect: a shard obeys whoever calls it."""
    _, _, uds = server
    assert os.stat(f"{uds}-0").st_mode & 0o777 == 0o600


def test_sigterm_exits_cleanly(server, stub):
    """Runs last: the server stops on SIGTERM with status 0 and removes its socket."""
    proc, _, uds = server
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert not os.path.exists(f"{uds}-0")


# --- in-process: warmup sizing, logprobs, the CLI's other paths ----------------


def test_warmup_sizes_cache_from_kv_cache_bytes(model_dir):
    from sluice_server.model_runner import ModelRunner
    from sluice_server.servicer import Shard

    runner = ModelRunner(model_dir, block_size=BLOCK)
    per_block = runner.bytes_per_block()  # 2 (k, v) * 2 layers * 4 slots * 2 heads * 16 dims * 4 bytes
    assert per_block == 2 * 2 * BLOCK * 2 * 16 * 4
    shard = Shard(runner, urls=[], kv_cache_bytes=100 * per_block + 7)
    warm = shard.warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=40, max_batch_size=4, max_total_tokens=32))
    assert warm.num_blocks == 100 and warm.kv_cache_bytes == 100 * per_block
    from sluice_server.model_runner import KVBudgetError

    shard.kv_cache_bytes = 3 * per_block  # 12 slots < one request of 32 tokens
    with pytest.raises(KVBudgetError):
        shard.warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=40, max_batch_size=4, max_total_tokens=32))


def test_warmup_says_whether_kernels_may_still_compile(model_dir, monkeypatch):
    """The router gives the first steps its longer deadline only when the
    shard says compilation is pending: never on CPU (the C++ kernels are built
    before warmup), while Triton may still JIT a kernel for a new shape."""
    from sluice_server.layers.triton_attention import TritonAttention
    from sluice_server.model_runner import ModelRunner
    from sluice_server.servicer import Shard

    shard = Shard(ModelRunner(model_dir, block_size=BLOCK), urls=[], kv_cache_bytes=1 << 20)
    warm = shard.warmup(shard_pb2.WarmupRequest(max_batch_prefill_tokens=40, max_batch_size=4, max_total_tokens=32))
    assert warm.compilation_pending is False
    # The interpreter is asked, not the variable set: kernels imported while
    # TRITON_INTERPRET=0 would stay compiled-only for the rest of the session.
    from sluice_server.layers import triton_attention
    monkeypatch.setattr(triton_attention, "triton_interpreting", lambda: False)
    assert TritonAttention().compiles_lazily
    monkeypatch.setattr(triton_attention, "triton_interpreting", lambda: True)
    assert not TritonAttention().compiles_lazily


def test_cpu_shards_of_one_host_share_one_kv_budget(model_dir, monkeypatch):
    """Without --kv-cache-bytes the shards of a host split 30% of MemAvailable
    (they warm up at once and would each see the same free memory)."""
    from sluice_server import model_runner
    from sluice_server.servicer import Shard

    runner = model_runner.ModelRunner(model_dir, block_size=BLOCK)
    per_block = runner.bytes_per_block()
    monkeypatch.setattr(model_runner, "available_ram_bytes", lambda: 3000 * per_block)
    warm = shard_pb2.WarmupRequest(max_batch_prefill_tokens=40, max_batch_size=4, max_total_tokens=32)
    blocks = {}
    for shards in ("1", "3"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", shards)
        blocks[shards] = Shard(runner, urls=[]).warmup(warm).num_blocks
    assert blocks == {"1": 900, "3": 300}
    assert model_runner.cpu_kv_budget(10_000, 4) == 750


def test_logprobs_match_reference(model_dir):
    """Prompt logprobs gathered over three chunks, and the sampled token's
    logprob and top-n, equal log_softmax of transformers' logits."""
    from sluice_server.model_runner import ModelRunner
    from sluice_server.servicer import Shard

    from conftest import reference_logits

    tokens = [9, 8, 7, 6, 5, 4, 3, 30, 31, 32, 33]
    ref = torch.log_softmax(reference_logits(model_dir, tokens), dim=-1)
    runner = ModelRunner(model_dir, block_size=BLOCK)
    runner.allocate_kv_cache(8)
    shard = Shard(runner, urls=[])
    params = shard_pb2.SamplingParams(prompt_logprobs=True, logprobs=True, top_n_tokens=3)
    r = shard.step(shard_pb2.StepRequest(new_requests=[new_request(1, tokens, [5, 1, 6], num_new=4, params=params)]))
    assert not r.generations
    r = shard.step(shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=1, num_new_tokens=5)]))
    assert not r.generations
    r = shard.step(shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=1, num_new_tokens=2)]))
    (gen,) = r.generations
    got = torch.tensor([p.logprob for p in gen.prompt_logprobs])
    want = ref[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]
    assert [p.token_id for p in gen.prompt_logprobs] == tokens[1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert gen.token_id == int(ref[-1].argmax())
    assert abs(gen.logprob - float(ref[-1].max())) < 1e-4
    assert [t.token_id for t in gen.top_tokens] == ref[-1].topk(3).indices.tolist()
    # The next generation carries no prompt logprobs.
    r = shard.step(shard_pb2.StepRequest(scheduled=[shard_pb2.ScheduledRequest(id=1, num_new_tokens=1)]))
    assert len(r.generations) == 1 and not r.generations[0].prompt_logprobs


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=CHECKOUT_PYTHONPATH)
    return subprocess.run([sys.executable, "-m", "sluice_server.cli", *args], capture_output=True, text=True,
                          env=env, timeout=START_TIMEOUT_S)


def test_download_weights_prints_folder_last(model_dir):
    done = run_cli("download-weights", str(model_dir))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == str(model_dir)


def test_serve_unsupported_model_fails_clearly(tmp_path, model_dir):
    for name in ("config.json", "model.safetensors"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = (tmp_path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    (tmp_path / "config.json").write_text(config)
    done = run_cli("serve", str(tmp_path), "--uds-path", str(tmp_path / "s"))
    assert done.returncode == 1
    assert ("supported: gemma3_text, gpt_oss, llama, mistral, mixtral, phi3, qwen2, qwen2_moe, qwen3, qwen3_moe"
            in done.stderr)
