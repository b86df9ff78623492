"""sluice-bench against fake OpenAI-compatible servers: timing, load shapes,
seeded determinism, failure accounting, multi-turn sequencing, --compare."""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import pytest
from _bench_fakes import FakeServer, byte_level_bpe

from sluice_bench import cli
from sluice_bench.runner import BenchConfig, poisson_arrivals, run_benchmark_sync
from sluice_bench.workloads import WorkloadSpec

TOK = byte_level_bpe()
TOK_DIR = tempfile.mkdtemp(prefix="bench-tok-")
TOK.save(os.path.join(TOK_DIR, "tokenizer.json"))


def config(url, **kw) -> BenchConfig:
    """Uses the local tokenizer file (fast) unless told `tokenizer=None`, which
    sizes the prompts through the server's /tokenize."""
    spec = kw.pop("spec", WorkloadSpec(kind="random", num_prompts=6, input_len=32, output_len=5))
    kw.setdefault("tokenizer", TOK_DIR)
    return BenchConfig(base_url=url, spec=spec, progress=False, **kw)


def test_random_run_measures_every_request():
    with FakeServer(TOK, ttft=0.03, gap=0.01, hold_until_in_flight=2) as server:
        r = run_benchmark_sync(config(server.url, concurrency=2, tokenizer=None))
        bodies = [b for _, _, b in server.generation_requests()]
    s = r.summary
    assert (s["completed"], s["failed"]) == (6, 0)
    assert s["total_output_tokens"] == 30 and s["output_tokens_from_usage"] == 6
    assert s["prompt_length_mismatches"] == {"checked": 6, "mismatched": 0, "examples": []}
    assert s["total_input_tokens"] == 6 * 32
    assert server.max_in_flight == 2
    # Timings come from the stream. Lower bounds only, which hold however busy
    # the machine: the server waits 30 ms before the first token and 10 ms
    # before each of the 4 others, and a chunk cannot arrive before it is
    # sent (it can arrive late, and then the gap after it looks short).
    assert s["ttft_ms"]["min"] >= 30.0
    assert s["e2el_ms"]["min"] >= 30.0 + 4 * 10.0
    assert s["itl_ms"]["n"] == 6 * 4
    # The definitions: ttft + the gaps = e2el; tpot = (e2el - ttft) / (n - 1).
    for rec in r.records:
        assert len(rec.itl) == rec.output_tokens - 1 == 4
        assert rec.ttft + sum(rec.itl) == pytest.approx(rec.e2el, abs=1e-9)
        assert rec.tpot == pytest.approx((rec.e2el - rec.ttft) / 4)
    assert r.model == "fake-model"
    for b in bodies:
        assert b["max_tokens"] == 5 and b["min_tokens"] == 5 and b["ignore_eos"] is True
        assert b["stream"] is True and b["stream_options"] == {"include_usage": True}
        assert len(TOK.encode(b["prompt"]).ids) == 32


def test_no_ignore_eos_leaves_the_vendor_fields_out():
    with FakeServer(TOK) as server:
        run_benchmark_sync(config(server.url, ignore_eos=False))
        bodies = [b for _, _, b in server.generation_requests()]
    assert all("ignore_eos" not in b and "min_tokens" not in b for b in bodies)


def test_the_api_key_is_sent_as_a_bearer_token():
    with FakeServer(TOK, api_key="sekrit") as server:
        good = run_benchmark_sync(config(server.url, api_key="sekrit"))
        bad = run_benchmark_sync(config(server.url, api_key="wrong", model="fake-model"))
    assert good.summary["completed"] == 6
    assert bad.summary["failed"] == 6 and bad.summary["errors"] == {"HTTP 401: bad api key": 6}


def test_a_server_counting_prompts_differently_is_reported():
    with FakeServer(TOK, extra_prompt_tokens=1) as server:
        r = run_benchmark_sync(config(server.url))
    m = r.summary["prompt_length_mismatches"]
    assert (m["checked"], m["mismatched"]) == (6, 6)
    assert m["examples"][0]["expected"] == 32 and m["examples"][0]["got"] == 33


def test_failures_are_counted_not_fatal():
    spec = WorkloadSpec(kind="random", num_prompts=9, input_len=16, output_len=3)
    with FakeServer(TOK, fail_every=3) as server:
        r = run_benchmark_sync(config(server.url, spec=spec, concurrency=1, goodput_ms={"ttft": 10_000}))
    s = r.summary
    assert (s["requests"], s["completed"], s["failed"]) == (9, 6, 3)
    assert s["errors"] == {"HTTP 500: injected failure": 3}
    assert [rec.ok for rec in r.records] == [True, True, False] * 3
    assert [rec.status for rec in r.records if not rec.ok] == [500] * 3
    assert s["total_output_tokens"] == 18
    assert s["goodput"]["good_requests"] == 6


def test_a_stream_cut_short_is_a_failure():
    with FakeServer(TOK, truncate_after=2) as server:
        r = run_benchmark_sync(config(server.url))
    assert r.summary["failed"] == 6 and r.summary["errors"] == {"stream ended before [DONE]": 6}


def test_timeouts_become_failed_requests():
    spec = WorkloadSpec(kind="random", num_prompts=2, input_len=8, output_len=2)
    with FakeServer(TOK, ttft=1.0) as server:
        r = run_benchmark_sync(config(server.url, spec=spec, timeout=0.2, concurrency=2))
    assert r.summary["failed"] == 2 and r.summary["errors"] == {"timeout after 0.2s": 2}


def test_the_timeout_bounds_the_whole_request_not_one_read():
    # every gap (50 ms) is well within the timeout, the whole stream (~450 ms) is not
    spec = WorkloadSpec(kind="random", num_prompts=1, input_len=8, output_len=10)
    with FakeServer(TOK, ttft=0.01, gap=0.05) as server:
        r = run_benchmark_sync(config(server.url, spec=spec, timeout=0.2))
    assert r.summary["errors"] == {"timeout after 0.2s": 1}


def test_an_unreachable_server_fails_cleanly(tmp_path, capsys):
    TOK.save(str(tmp_path / "tokenizer.json"))
    code = cli.main(["--base-url", "http://127.0.0.1:9", "--model", "m", "--tokenizer", str(tmp_path),
                     "--num-prompts", "2", "--input-len", "8", "--output-len", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 1
    assert "Successful / failed requests:" in out and "0 / 2" in out and "ConnectError" in out


def test_same_seed_same_requests_in_the_same_order():
    def bodies(seed):
        with FakeServer(TOK) as server:
            run_benchmark_sync(config(server.url, seed=seed, concurrency=1, warmup=2))
            return [b for _, _, b in server.generation_requests()]

    a, b, c = bodies(11), bodies(11), bodies(12)
    assert len(a) == 8 and a == b
    assert a != c
    # warm-up prompts are not the measured ones
    assert not {x["prompt"] for x in a[:2]} & {x["prompt"] for x in a[2:]}


def test_poisson_arrivals_have_the_requested_mean_rate():
    t = poisson_arrivals(20_000, 5.0, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.05)
    assert poisson_arrivals(50, 5.0, 1) == t[:50]
    assert poisson_arrivals(50, 5.0, 2) != t[:50]


def test_a_seeded_poisson_run_sends_at_the_planned_times():
    """Never before its planned time, and without waiting for earlier answers:
    the server answers nobody before all 6 requests are in flight, so a
    client that waited for answers would never send the later ones (and its
    requests would time out). How late a send may be is the event loop's lag,
    measured by benchmarks, not asserted here."""
    spec = WorkloadSpec(kind="random", num_prompts=6, input_len=8, output_len=2)
    planned = poisson_arrivals(6, 5.0, seed=4)

    def starts():
        with FakeServer(TOK, hold_until_in_flight=6) as server:
            r = run_benchmark_sync(config(server.url, spec=spec, seed=4, request_rate=5.0, concurrency=None))
        assert r.summary["completed"] == 6 and r.load == {"request_rate": 5.0, "max_concurrency": None}
        assert server.max_in_flight == 6
        return [rec.start for rec in r.records]

    for run in (starts(), starts()):
        for start, plan in zip(run, planned):
            assert start >= plan - 0.002  # perf_counter's granularity and float rounding


def test_max_concurrency_caps_poisson_load():
    spec = WorkloadSpec(kind="random", num_prompts=8, input_len=8, output_len=4)
    with FakeServer(TOK, ttft=0.02, hold_until_in_flight=2) as server:
        r = run_benchmark_sync(config(server.url, spec=spec, request_rate=1000.0, concurrency=None, max_concurrency=2))
    assert r.summary["completed"] == 8 and server.max_in_flight == 2


def test_multi_turn_resends_history_and_waits_for_each_answer():
    spec = WorkloadSpec(kind="multi-turn", num_conversations=2, num_turns=3, input_len=8, output_len=3)
    with FakeServer(TOK, ttft=0.01) as server:
        r = run_benchmark_sync(config(server.url, spec=spec, concurrency=2))
        received = server.generation_requests()
        finished = server.finished
    assert r.summary["completed"] == 6
    assert {path for _, path, _ in received} == {"/v1/chat/completions"}
    by_conv: dict[str, list] = {}
    for t, _, body in received:
        by_conv.setdefault(body["messages"][0]["content"], []).append((t, body))
    assert len(by_conv) == 2
    for turns in by_conv.values():
        assert [len(b["messages"]) for _, b in turns] == [1, 3, 5]
        # each turn carries the previous answers verbatim
        assert [m["content"] for m in turns[2][1]["messages"] if m["role"] == "assistant"] == [" t0 t1 t2"] * 2
        for (_, prev), (t_next, _) in zip(turns, turns[1:]):
            done = next(ft for ft, fb in finished if fb is prev)
            assert t_next >= done
    # the server's toy template adds 4 tokens a message: prompt_tokens grow per turn
    prompt_tokens = [rec.prompt_tokens for rec in r.records if rec.session == 0]
    assert prompt_tokens[0] < prompt_tokens[1] < prompt_tokens[2]


def test_a_failed_turn_ends_its_conversation():
    spec = WorkloadSpec(kind="multi-turn", num_conversations=1, num_turns=3, input_len=8, output_len=2)
    with FakeServer(TOK, fail_every=2) as server:
        r = run_benchmark_sync(config(server.url, spec=spec))
    assert [rec.ok for rec in r.records] == [True, False, False]
    assert r.records[2].error.startswith("skipped")
    assert len(server.generation_requests()) == 2


def test_chat_role_chunk_is_not_the_first_token():
    with FakeServer(TOK, ttft=0.08) as server:
        r = run_benchmark_sync(config(server.url, endpoint="chat"))
    assert r.summary["ttft_ms"]["min"] >= 80.0
    assert r.summary["prompt_length_mismatches"]["checked"] == 0  # chat: template unknown


def test_compare_two_servers_side_by_side(tmp_path, capsys):
    TOK.save(str(tmp_path / "tokenizer.json"))
    out_json, plots = tmp_path / "r.json", tmp_path / "plots"
    with FakeServer(TOK, ttft=0.01, gap=0.002) as fast, FakeServer(TOK, ttft=0.05, gap=0.03) as slow:
        code = cli.main([
            "--compare", fast.url, slow.url, "--labels", "fast", "slow", "--tokenizer", str(tmp_path),
            "--num-prompts", "4", "--input-len", "16", "--output-len", "6", "--concurrency", "1,2",
            "--hourly-cost", "2.5", "--goodput", "ttft:1000", "--out", str(out_json), "--plot", str(plots),
            "--save-requests", "--no-progress",
        ])
        fast_prompts = [b["prompt"] for _, _, b in fast.generation_requests()]
        slow_prompts = [b["prompt"] for _, _, b in slow.generation_requests()]
    text = capsys.readouterr().out
    assert code == 0
    # identical workload for both servers (at concurrency 2 two requests leave
    # together, so only the set of that level is fixed, not the arrival order)
    assert fast_prompts[:4] == slow_prompts[:4] and sorted(fast_prompts[4:]) == sorted(slow_prompts[4:])
    # each sweep level has its own prompts: no prefix cache carries over
    assert not set(fast_prompts[:4]) & set(fast_prompts[4:])
    doc = json.loads(out_json.read_text())
    runs = doc["runs"]
    assert [(r["label"], r["load"]["concurrency"]) for r in runs] == [("fast", 1), ("fast", 2), ("slow", 1), ("slow", 2)]
    assert [r["base_url"] for r in runs] == [fast.url, fast.url, slow.url, slow.url]
    assert len(runs[0]["requests"]) == 4 and doc["versions"]["sluice_bench"]
    for c, (f, s) in enumerate([(runs[0], runs[2]), (runs[1], runs[3])], start=1):
        fs, ss = f["summary"], s["summary"]
        # (Which server is faster is a measurement; the columns must hold
        # each server's own numbers and the ratios between them.)
        # the printed ratio of the slow column is slow / fast
        block = text.split(f"concurrency {c} |")[-1]
        row = next(line for line in block.splitlines() if line.startswith("Output tok/s"))
        assert f"(x{ss['output_throughput'] / fs['output_throughput']:.2f})" in row
        row = next(line for line in block.splitlines() if line.startswith("TPOT median (ms)"))
        assert f"(x{ss['tpot_ms']['median'] / fs['tpot_ms']['median']:.2f})" in row
        for summary in (fs, ss):
            assert summary["dollars_per_million_output_tokens"] > 0
    for name in ("latency.png", "throughput.png"):
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_goes_on_when_one_server_is_down(capsys):
    with FakeServer(TOK) as up:
        code = cli.main(["--compare", up.url, "http://127.0.0.1:9", "--labels", "up", "down", "--tokenizer", TOK_DIR,
                         "--num-prompts", "3", "--input-len", "8", "--output-len", "2", "--no-progress"])
    text = capsys.readouterr().out
    assert code == 1  # a column with nothing completed is not a result
    assert "skipping down: cannot learn the model name" in text
    row = next(line for line in text.splitlines() if line.startswith("Completed / failed"))
    assert row.split()[-6:] == ["3", "/", "0", "0", "/", "3"]


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency: values must be positive"),
    (["--concurrency", "a,b"], "not a comma-separated list"),
    (["--compare", "http://a", "http://b", "--labels", "one"], "--labels gives 1 names for 2 URLs"),
    (["--base-url", "localhost:8080"], "must start with http"),
    (["--goodput", "ttft"], "goodput target"),
    (["--workload", "random", "--input-len", "0"], "input-len must be at least 1"),
])
def test_bad_arguments_give_a_clear_error(argv, message, capsys):
    assert cli.main(argv + ["--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_says_what_to_install_before_running(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    with FakeServer(TOK) as server:
        code = cli.main(["--base-url", server.url, "--tokenizer", TOK_DIR, "--num-prompts", "2",
                         "--plot", str(tmp_path / "charts"), "--no-progress"])
        sent = server.generation_requests()
    assert code == 2 and "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err
    assert sent == []


def test_without_a_tokenizer_the_user_is_told_what_to_pass(capsys):
    with FakeServer(TOK, tokenize=False) as server:
        code = cli.main(["--base-url", server.url, "--num-prompts", "1", "--no-progress"])
    assert code == 2
    assert "pass --tokenizer" in capsys.readouterr().err
