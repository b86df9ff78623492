"""The servicer under faults: a cancelled call never releases the model lock
while its worker thread runs, a failure past validation on a tensor-parallel
rank ends the shard, and SLUICE_FAULT parses strictly."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from sluice_server import faults
from sluice_server.servicer import ModelThread, ShardServicer


class FakeContext:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, message):
        self.aborted = (code, message)
        raise RuntimeError("aborted")  # grpc.aio's abort raises too


def servicer(world_size: int = 1) -> tuple[ShardServicer, list[str]]:
    fatal: list[str] = []
    shard = SimpleNamespace(runner=SimpleNamespace(dist=SimpleNamespace(is_parallel=world_size > 1)))
    return ShardServicer(shard, fatal=fatal.append), fatal


def test_a_cancelled_call_holds_the_lock_until_its_thread_is_done():
    """grpc.aio cancels a handler whose caller left; the next model call must
    still wait for the cancelled one's thread (it may be in a collective)."""
    service, _ = servicer(world_size=2)
    spans: list[tuple[str, float, float]] = []
    release = threading.Event()

    def model_call(name: str, wait: threading.Event | None):
        start = time.monotonic()
        if wait is not None:
            assert wait.wait(timeout=30), "the test never released the first call"
        spans.append((name, start, time.monotonic()))
        return name

    async def main():
        first = asyncio.ensure_future(service._run(FakeContext(), model_call, "first", release))
        await asyncio.sleep(0.2)  # the first call's thread is running
        first.cancel()
        second = asyncio.ensure_future(service._run(FakeContext(), model_call, "second", None))
        await asyncio.sleep(0.2)
        assert not second.done(), "the second call ran while the first's thread was still working"
        assert service.lock.locked()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(first, 30)
        assert await asyncio.wait_for(second, 30) == "second"

    asyncio.run(main())
    (name1, _, end1), (name2, start2, _) = spans
    assert (name1, name2) == ("first", "second")
    assert start2 >= end1


def test_model_calls_share_one_thread_with_its_torch_threads():
    import torch

    main_threads = torch.get_num_threads()
    model_thread = ModelThread(num_threads=1)
    service = ShardServicer(servicer()[0].shard, model_thread=model_thread)

    def where():
        return threading.get_ident(), torch.get_num_threads()

    async def main():
        return [await service._run(FakeContext(), where) for _ in range(4)]

    seen = asyncio.run(main())
    model_thread.shutdown()
    assert len(set(seen)) == 1, seen
    ident, threads = seen[0]
    assert ident != threading.get_ident() and threads == 1
    assert torch.get_num_threads() == main_threads  # set on the model thread only


def test_an_internal_error_on_a_parallel_rank_is_fatal():
    for world_size, expect_fatal in ((1, False), (2, True)):
        service, fatal = servicer(world_size)

        def broken():
            raise RuntimeError("collective failed")

        context = FakeContext()
        with pytest.raises(RuntimeError, match="aborted"):
            asyncio.run(service._run(context, broken))
        assert context.aborted[0] == grpc.StatusCode.INTERNAL
        assert bool(fatal) == expect_fatal, fatal
        if expect_fatal:
            assert "collective failed" in fatal[0]


def test_a_rejected_step_is_not_fatal():
    from sluice_server.batch import InvalidStep

    service, fatal = servicer(world_size=2)

    def invalid():
        raise InvalidStep("block 99 out of range")

    context = FakeContext()
    with pytest.raises(RuntimeError, match="aborted"):
        asyncio.run(service._run(context, invalid))
    assert context.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert fatal == []


def test_fault_injection_parses_strictly():
    assert faults.from_env(0, {}).fail_at_step == 0
    assert faults.from_env(1, {"SLUICE_FAULT": "shard-step-error:1:3"}).fail_at_step == 3
    assert faults.from_env(0, {"SLUICE_FAULT": "shard-step-error:1:3"}).fail_at_step == 0
    assert faults.from_env(0, {"SLUICE_FAULT": "router-scheduler-panic:2"}).fail_at_step == 0
    for bad in ("shard-step-error:1", "shard-step-error:x:1", "shard-step-error:0:0", "nonsense"):
        with pytest.raises(ValueError, match="SLUICE_FAULT"):
            faults.from_env(0, {"SLUICE_FAULT": bad})
    fault = faults.Faults(fail_at_step=2)
    fault.before_forward()
    with pytest.raises(faults.InjectedFault):
        fault.before_forward()
    fault.before_forward()  # only the N-th step fails
