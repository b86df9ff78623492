"""The Batch API end to end with the real `openai` client: upload, create,
poll, download; each line's answer equals the same request sent online
(greedy); bad input gets the 4xx that names it and cannot hurt the store.

One launcher (tiny random-weight model, float32) serves the module.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from openai import OpenAI

from conftest import start_launcher

MAX_FILE_BYTES = 64 * 1024
MAX_LINES = 200
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    launcher = start_launcher(
        "--model-id", str(tiny_model_dir), "--dtype", "float32", "--hourly-cost", "2.5",
        "--batch-max-file-bytes", str(MAX_FILE_BYTES), "--batch-max-lines", str(MAX_LINES),
        "--max-total-tokens", "512", "--max-batch-prefill-tokens", "256",
        # Lines run in waves: later ones find the shared system prompt
        # cached, and a cancel lands while most still wait.
        "--max-batch-size", "8",
        tmp=tmp_path_factory.mktemp("batch-api"),
    )
    yield launcher
    launcher.stop()


@pytest.fixture(scope="module")
def client(server) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="-", max_retries=0)


def jsonl(lines: list) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id: str, content: str, system: str | None = None, **extra) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def wait_done(client: OpenAI, batch_id: str, timeout: float = 180) -> tuple:
    """Polls until the batch ends; returns it and every status seen."""
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != batch.status:
            seen.append(batch.status)
        if batch.status in TERMINAL:
            return batch, seen
        assert time.monotonic() < deadline, f"batch still {batch.status} after {timeout}s: {batch}"
        time.sleep(0.2)


def read_lines(client: OpenAI, file_id: str) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def metric(base_url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"{base_url}/metrics").text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_a_chat_batch_answers_as_the_online_api_does(server, client):
    # Long enough that one step's budget prefills only a few lines: the
    # others find its blocks in the prefix cache.
    system = "You are a terse assistant. Answer in one short sentence. " * 12
    requests = [chat_line(f"req-{i}", f"Question number {i}: name a colour.", system=system) for i in range(5)]
    requests.append(chat_line("no-system", "Hello there", seed=3, max_tokens=6))
    broken = {"custom_id": "broken-body", "method": "POST", "url": "/v1/chat/completions",
              "body": {"max_tokens": 4}}  # no messages: the endpoint's own 400
    lines = [*requests, broken, '{"custom_id": "cut-off", "method": "POST"', chat_line("wrong-url", "x") | {"url": "/v1/completions"}]
    generated_before = metric(server.base_url, "sluice_batch_api_generated_tokens_total")

    uploaded = client.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert (uploaded.purpose, uploaded.bytes, uploaded.filename) == ("batch", len(jsonl(lines)), "questions.jsonl")
    assert client.files.retrieve(uploaded.id).id == uploaded.id
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"job": "colours"})
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"job": "colours"}
    batch, seen = wait_done(client, batch.id)
    order = ["validating", "in_progress", "finalizing", "completed"]
    assert seen == sorted(seen, key=order.index), seen  # only forward, as documented
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (9, 6, 3)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at

    outputs = {line["custom_id"]: line for line in read_lines(client, batch.output_file_id)}
    assert sorted(outputs) == sorted(r["custom_id"] for r in requests)
    prompt_tokens = completion_tokens = cached = 0
    for request in requests:
        line = outputs[request["custom_id"]]
        assert line["error"] is None and line["response"]["status_code"] == 200
        assert line["id"].startswith("batch_req_")
        answer = line["response"]["body"]
        online = client.chat.completions.create(model=client.models.list().data[0].id, **request["body"])
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"] == online.choices[0].message.content, request["custom_id"]
        assert answer["choices"][0]["finish_reason"] == online.choices[0].finish_reason
        assert answer["usage"]["completion_tokens"] == online.usage.completion_tokens
        assert answer["usage"]["prompt_tokens"] == online.usage.prompt_tokens
        prompt_tokens += answer["usage"]["prompt_tokens"]
        completion_tokens += answer["usage"]["completion_tokens"]
        cached += answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    # Five lines share a system prompt: the prefix cache serves it.
    assert cached > 0

    errors = {line["custom_id"]: line for line in read_lines(client, batch.error_file_id)}
    assert set(errors) == {"broken-body", None, "wrong-url"}
    assert errors["broken-body"]["response"]["status_code"] == 400
    assert "messages" in errors["broken-body"]["response"]["body"]["error"]["message"]
    assert errors[None]["response"] is None and errors[None]["error"]["code"] == "invalid_request_line"
    assert errors[None]["error"]["message"].startswith("line 8: not valid JSON")
    assert "differs from the batch's endpoint" in errors["wrong-url"]["error"]["message"]

    usage = batch.model_extra.get("usage") or batch.usage.model_dump()
    assert usage["input_tokens"] == prompt_tokens and usage["output_tokens"] == completion_tokens
    assert usage["input_tokens_details"]["cached_tokens"] == cached
    assert usage["compute_seconds"] > 0
    assert usage["cost_dollars"] == pytest.approx(2.5 * usage["compute_seconds"] / 3600)
    assert metric(server.base_url, "sluice_batch_api_generated_tokens_total") - generated_before == completion_tokens

    page = client.batches.list(limit=1)
    assert page.data[0].id == batch.id and page.has_more in (True, False)


def test_a_completions_batch_answers_as_the_online_api_does(client):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"prompt": p, "max_tokens": 6, "temperature": 0}} for i, p in enumerate(prompts)]
    uploaded = client.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h")
    batch, _ = wait_done(client, batch.id)
    assert batch.status == "completed" and batch.error_file_id is None
    outputs = {line["custom_id"]: line["response"]["body"] for line in read_lines(client, batch.output_file_id)}
    for line in lines:
        online = client.completions.create(model=client.models.list().data[0].id, **line["body"])
        assert outputs[line["custom_id"]]["choices"][0]["text"] == online.choices[0].text


def test_paging_lists_newest_first(client):
    ids = []
    for i in range(3):
        uploaded = client.files.create(file=(f"p{i}.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
        ids.append(client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == ids[::-1][:2] and first.has_more
    second = client.batches.list(limit=2, after=first.data[-1].id)
    assert second.data[0].id == ids[0]
    for batch_id in ids:
        wait_done(client, batch_id)


def test_cancel_keeps_what_finished(client):
    lines = [chat_line(f"long-{i}", f"Tell a long story about the number {i}.", max_tokens=64, ignore_eos=True)
             for i in range(60)]
    uploaded = client.files.create(file=("long.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).request_counts.completed == 0:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    batch, _ = wait_done(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at
    done = batch.request_counts.completed
    assert 0 < done < 60
    assert len(read_lines(client, batch.output_file_id)) == done
    assert client.batches.cancel(batch.id).status == "cancelled"  # asking again answers its state
    with pytest.raises(openai.ConflictError, match="completed and can no longer be cancelled"):
        client.batches.cancel(_completed_batch(client))


def _completed_batch(client: OpenAI) -> str:
    uploaded = client.files.create(file=("one.jsonl", jsonl([chat_line("one", "hi")])), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h")
    return wait_done(client, batch.id)[0].id


# -- bad input --------------------------------------------------------------

def test_bad_uploads_are_refused_by_name(server, client):
    good = chat_line("a", "hi")
    with pytest.raises(openai.BadRequestError, match="is used by lines 1 and 3") as duplicate:
        client.files.create(file=("d.jsonl", jsonl([chat_line("dup", "x"), good, chat_line("dup", "y")])), purpose="batch")
    assert '"dup"' in str(duplicate.value)
    with pytest.raises(openai.APIStatusError) as oversize:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert oversize.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as far_oversize:
        client.files.create(file=("bigger.jsonl", b"x" * (4 * MAX_FILE_BYTES)), purpose="batch")
    assert far_oversize.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="more than 200 request lines"):
        client.files.create(file=("many.jsonl", jsonl([chat_line(f"m{i}", "x") for i in range(MAX_LINES + 1)])),
                            purpose="batch")
    with pytest.raises(openai.BadRequestError, match="not UTF-8"):
        client.files.create(file=("bin.jsonl", b'{"custom_id": "\xff\xfe"}\n'), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="only .batch. is"):
        client.files.create(file=("ft.jsonl", jsonl([good])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="no request line"):
        client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    # Not multipart at all, and multipart without a file.
    response = httpx.post(f"{server.base_url}/v1/files", json={"purpose": "batch"})
    assert response.status_code == 400 and "multipart" in response.json()["error"]["message"]
    response = httpx.post(f"{server.base_url}/v1/files", data={"purpose": "batch"}, files={"other": ("x", b"y")})
    assert response.status_code == 400 and "`file` field is missing" in response.json()["error"]["message"]


def test_unknown_ids_are_404(client):
    for call in (
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("file-nope"),
        lambda: client.files.delete("file-nope"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
        lambda: client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"),
        lambda: client.batches.list(after="batch_nope"),
        # Ids are bound parameters, never SQL.
        lambda: client.files.retrieve("x'; DROP TABLE files; --"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()


def test_bad_batch_requests_name_the_field(client):
    uploaded = client.files.create(file=("ok.jsonl", jsonl([chat_line("a", "hi")])), purpose="batch")
    cases = [
        (dict(endpoint="/v1/embeddings"), "`endpoint`"),
        (dict(completion_window="1h"), "`completion_window`"),
        (dict(metadata={f"k{i}": "v" for i in range(17)}), "`metadata` has 17 keys"),
    ]
    for change, named in cases:
        args = dict(input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h") | change
        with pytest.raises(openai.BadRequestError, match=named):
            client.batches.create(**args)
    with pytest.raises(openai.BadRequestError, match="`limit`"):
        client.batches.list(limit=1000)


def test_garbage_cannot_corrupt_the_store(server, client):
    import random

    rng = random.Random(7)
    for i in range(20):
        blob = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 4000)))
        response = httpx.post(f"{server.base_url}/v1/files", data={"purpose": "batch"},
                              files={"file": (f"g{i}'\";.jsonl", blob)})
        assert response.status_code in (200, 400), response.text
    # Lines of valid UTF-8 that are no requests: stored, then every line is
    # an error line of its batch, and the batch still completes.
    junk = "\n".join(["[]", "null", '{"custom_id": "j1"}', '"\\u0000"', "{" * 5000, '{"custom_id": "j2", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "no"}}'])
    uploaded = client.files.create(file=("junk.jsonl", junk.encode()), purpose="batch")
    batch, _ = wait_done(client, client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.failed == 6 and batch.output_file_id is None
    assert len(read_lines(client, batch.error_file_id)) == 6
    # The store still works: a good batch runs, lists page, files delete.
    good = client.files.create(file=("after.jsonl", jsonl([chat_line("after", "hi")])), purpose="batch")
    batch, _ = wait_done(client, client.batches.create(input_file_id=good.id, endpoint="/v1/chat/completions",
                                                       completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 1
    assert client.files.list(limit=100).data
    assert client.files.delete(good.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(good.id)
    assert httpx.get(f"{server.base_url}/ready").status_code == 200
