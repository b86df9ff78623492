"""The gRPC Shard service.

`Shard` is the shard's state machine, synchronous and free of gRPC: the table
of held requests (`RequestState` by id) plus the model runner. A Step:

    1. check_step validates the whole request; a malformed step changes nothing.
    2. finished_ids are dropped (unknown ids are ignored: the shard may have
       dropped a request already, after a RequestError).
    3. ModelRunner.run_step: one forward over all new tokens, then prompt
       logprobs and sampling for the rows that need them (nothing changes yet).
    4. State commits: num_computed_tokens advances, blocks are appended,
       prompt logprobs accumulate; each sampled token is appended to its
       request's token_ids and returned as a Generation.

A request with draft tokens (speculative decoding) commits only what the
runner verified: its emitted tokens are appended, num_computed_tokens stops
after the accepted drafts, and its block table is cut to the blocks that
hold computed slots (the router cuts its own the same way; the proto's
ScheduledRequest.draft_token_ids says how).

LoRA adapters: LoadAdapter / UnloadAdapter fill and empty the model runner's
adapter slots (adapters.py) between steps; a NewRequest names the slot its
adapter is in. A slot a held request uses is never refilled or emptied.

Constrained requests (structured output, tool calls) get a matcher when they
arrive (constraints.Grammar, rebuilt from prompt + generated tokens for a
resumed one); the runner masks their rows before sampling and the commit
advances the matcher by the sampled token. With no constrained request held,
none of this runs.

`ShardServicer` is the grpc.aio wrapper: it serialises calls that touch the
model, runs them on the model thread (`ModelThread`), off the event loop, and
maps errors to status codes.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import grpc

from sluice_server import constraints, telemetry
from sluice_server.faults import Faults
from sluice_server.batch import CheckedStep, InvalidStep, ShardLimits, RequestState, Work, check_step
from sluice_server.model_runner import KVBudgetError, ModelRunner, StepOutput
from sluice_server.pb import shard_pb2, shard_pb2_grpc
from sluice_server.sampling import SampledToken

log = logging.getLogger(__name__)


class NotWarmedUp(RuntimeError):
    """Step before Warmup: there is no KV cache yet (FAILED_PRECONDITION)."""


class SlotInUse(RuntimeError):
    """An adapter slot that a held request uses cannot change (FAILED_PRECONDITION)."""


class Shard:
    def __init__(
        self, runner: ModelRunner, urls: list[str], kv_cache_bytes: int | None = None, faults: Faults | None = None
    ):
        self.runner = runner
        self.faults = faults or Faults()
        self.urls = urls
        self.kv_cache_bytes = kv_cache_bytes
        self.requests: dict[int, RequestState] = {}
        # Ids of held requests that have a grammar: while empty, no step does
        # any constraint work.
        self.constrained: set[int] = set()
        self.grammar_tokenizer = constraints.GrammarTokenizer(
            runner.model_dir / "tokenizer.json", runner.vocab_size, runner.eos_token_ids
        )

    def info(self) -> shard_pb2.InfoResponse:
        r = self.runner
        return shard_pb2.InfoResponse(
            model_type=r.model_type,
            dtype=str(r.dtype).removeprefix("torch."),
            device_type=r.device.type,
            world_size=r.dist.world_size,
            rank=r.dist.rank,
            block_size=r.block_size,
            vocab_size=r.vocab_size,
            eos_token_ids=r.eos_token_ids,
            max_position_embeddings=r.max_position_embeddings,
            attention_backend=r.backend.name,
            kv_cache_dtype=str(r.kv_dtype).removeprefix("torch."),
            cpu_matmuls=r.cpu_matmuls.describe() if r.cpu_matmuls else "",
            cpu_kernels=r.cpu_kernels_isa,
            weight_bytes=r.weight_bytes,
            dense_copy_bytes=r.dense_copy_bytes,
            max_weight_memory=r.options.max_weight_memory or 0,
            total_parameters=r.total_parameters,
            active_parameters=r.active_parameters,
            max_loras=r.adapters.max_loras,
            max_lora_rank=r.adapters.max_rank,
            expert_parallel=r.expert_parallel,
            lora_dtype=str(r.lora_dtype).removeprefix("torch.") if r.adapters.enabled else "",
        )

    def warmup(self, req: shard_pb2.WarmupRequest) -> shard_pb2.WarmupResponse:
        self.clear()  # the cache is reallocated: nothing held survives
        # llguidance's token trie takes a second: built now, not on the
        # first constrained request.
        self.grammar_tokenizer.load()
        result = self.runner.warmup(
            req.max_batch_prefill_tokens, req.max_batch_size, req.max_total_tokens, self.kv_cache_bytes
        )
        return shard_pb2.WarmupResponse(
            num_blocks=result.num_blocks,
            kv_cache_bytes=result.kv_cache_bytes,
            compilation_pending=result.compilation_pending,
            lora_bytes=result.lora_bytes,
        )

    def load_adapter(self, req: shard_pb2.LoadAdapterRequest) -> shard_pb2.LoadAdapterResponse:
        """Checks the adapter at req.path, and with a slot loads it there."""
        adapters = self.runner.adapters
        for rid in req.finished_ids:
            self._drop(rid)
        if req.slot == 0:
            adapter = adapters.read(req.path)
        else:
            self._check_slot_free(req.slot)
            if not adapters.allocated:
                raise NotWarmedUp("LoadAdapter before Warmup: the adapter slots are not allocated")
            adapter = adapters.load(req.slot, req.path)
            log.info("adapter slot %d: %s (rank %d, %s)", req.slot, req.path, adapter.rank,
                     ", ".join(adapter.target_modules))
        return shard_pb2.LoadAdapterResponse(rank=adapter.rank, target_modules=adapter.target_modules)

    def unload_adapter(self, req: shard_pb2.UnloadAdapterRequest) -> shard_pb2.UnloadAdapterResponse:
        for rid in req.finished_ids:
            self._drop(rid)
        self._check_slot_free(req.slot)
        if not self.runner.adapters.allocated:
            raise NotWarmedUp("UnloadAdapter before Warmup: the adapter slots are not allocated")
        self.runner.adapters.unload(req.slot)
        return shard_pb2.UnloadAdapterResponse()

    def _check_slot_free(self, slot: int) -> None:
        users = [rid for rid, state in self.requests.items() if state.adapter_slot == slot]
        if users:
            raise SlotInUse(f"adapter slot {slot} is in use by request(s) {', '.join(map(str, users[:8]))}")

    def clear(self) -> None:
        self.requests.clear()
        self.constrained.clear()

    def _drop(self, rid: int) -> None:
        self.requests.pop(rid, None)
        self.constrained.discard(rid)

    def health_check(self) -> None:
        """One token through the whole model in a scratch cache; raises on failure.

        With several ranks a forward pass is a collective: a Health call that
        one rank served before a concurrent Step and another after would pair
        mismatched all-reduces. There, answering at all is the health signal.
        """
        if not self.runner.dist.is_parallel:
            self.runner.forward_probe()

    def step(self, req: shard_pb2.StepRequest) -> shard_pb2.StepResponse:
        t0 = time.perf_counter()
        cache = self.runner.kv_cache
        if cache is None:
            raise NotWarmedUp("Step before Warmup: the KV cache is not allocated")
        limits = ShardLimits(
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            vocab_size=self.runner.vocab_size,
            adapter_slots=self.runner.adapters.held_slots(),
        )
        checked = check_step(self.requests, req, limits)
        arriving_constrained = self._attach_grammars(req, checked)
        for rid in req.finished_ids:
            self._drop(rid)
        response = shard_pb2.StepResponse()
        for rid, message in checked.errors:
            response.errors.add(id=rid, message=message)
        if not checked.work:
            response.timings.prepare_ms = (time.perf_counter() - t0) * 1e3
            return response

        t1 = time.perf_counter()
        self.faults.before_forward()
        output = self.runner.run_step(checked.work, constrained=bool(self.constrained) or arriving_constrained)
        t2 = time.perf_counter()
        self._commit(checked.new_states, output, response)
        timings = [output.prepare_s, output.forward_s, output.sampling_s + time.perf_counter() - t2]
        if any(w.decode_steps > 1 for w in checked.work):
            self._decode_more(checked.work, response, timings)
        response.timings.prepare_ms = (t1 - t0 + timings[0]) * 1e3
        response.timings.forward_ms = timings[1] * 1e3
        response.timings.sampling_ms = timings[2] * 1e3
        return response

    def _decode_more(self, work: list[Work], response: shard_pb2.StepResponse, timings: list[float]) -> None:
        """Multi-step decode: requests that asked for N > 1 draws decode again
        from the token just drawn, N draws in all, each request stopping
        after one of its stop tokens (or an error, which drops it). Each
        pass is an ordinary step of the requests still going; afterwards
        every such request's table is cut to the blocks of its computed KV:

            before: token_ids [0, L), table for L + N - 1 slots
            after:  token_ids [0, L + n), num_computed_tokens = L + n - 1
        """
        more = [w for w in work if w.decode_steps > 1]
        left = {w.state.id: w.decode_steps - 1 for w in more}
        going = [w for w in more if self._decodes_on(w)]
        while going:
            step = [Work(w.state, w.state.num_computed_tokens, 1, w.state.block_ids) for w in going]
            output = self.runner.run_step(step)
            t0 = time.perf_counter()
            self._commit([], output, response)
            timings[0] += output.prepare_s
            timings[1] += output.forward_s
            timings[2] += output.sampling_s + time.perf_counter() - t0
            for w in going:
                left[w.state.id] -= 1
            going = [w for w in going if left[w.state.id] > 0 and self._decodes_on(w)]
        for w in more:
            state = w.state
            if state.id in self.requests:
                state.block_ids = state.block_ids[: -(-state.num_computed_tokens // self.runner.block_size)]

    def _decodes_on(self, w: Work) -> bool:
        """The request is still held and its last draw was not a stop token."""
        return w.state.id in self.requests and w.state.token_ids[-1] not in w.stop_token_ids

    def _attach_grammars(self, step: shard_pb2.StepRequest, checked: CheckedStep) -> bool:
        """Builds the matcher of each new constrained request; a failure
        (a grammar the shard cannot build) fails that request only. True
        when some new request is constrained."""
        sources = {r.id: r.grammar for r in step.new_requests if r.grammar}
        if not sources:
            return False
        failed: set[int] = set()
        for state in checked.new_states:
            source = sources.get(state.id)
            if source is None:
                continue
            try:
                generated = state.token_ids[state.num_prompt_tokens :]
                state.grammar = constraints.Grammar(self.grammar_tokenizer.get(), source, generated)
            except constraints.GrammarError as e:
                checked.errors.append((state.id, str(e)))
                failed.add(state.id)
        if failed:
            checked.new_states = [s for s in checked.new_states if s.id not in failed]
            checked.work = [w for w in checked.work if w.state.id not in failed]
        return True

    def _commit(self, new_states: list[RequestState], output: StepOutput, response: shard_pb2.StepResponse) -> None:
        """Applies a step the runner computed: new requests join the table,
        every request advances, sampled tokens are appended and reported."""
        for state in new_states:
            self.requests[state.id] = state
            if state.grammar is not None:
                self.constrained.add(state.id)
        for w in output.work:
            w.state.block_ids = w.block_ids
            w.state.num_computed_tokens = w.end
        for w, scored in output.prompt_logprobs:
            w.state.prompt_logprobs.extend(scored)
        for w, result in output.sampled:
            state = w.state
            error = result.error
            if error is None and state.grammar is not None:
                error = state.grammar.accept(result.token_id)
            if error is not None:
                response.errors.add(id=state.id, message=error)
                self._drop(state.id)
                continue
            gen = _emit(state, result, response)
            if state.prompt_logprobs is not None:
                for token_id, logprob in state.prompt_logprobs:
                    gen.prompt_logprobs.add(token_id=token_id, logprob=logprob)
                state.prompt_logprobs = None
        for w, emitted in output.verified:
            self._commit_verified(w, emitted, response)

    def _commit_verified(self, w: Work, emitted: list[SampledToken] | str, response: shard_pb2.StepResponse) -> None:
        """A speculating request keeps the KV of its accepted drafts only:

            before: token_ids [0, L), drafts at L .. L+K-1 written
            after:  token_ids [0, L + accepted + 1), num_computed_tokens = L + accepted,
                    block_ids = the first ceil(num_computed_tokens / block_size)
        """
        state = w.state
        if isinstance(emitted, str):
            response.errors.add(id=state.id, message=emitted)
            self._drop(state.id)
            return
        accepted = len(emitted) - 1
        state.num_computed_tokens = w.end + accepted
        state.block_ids = w.block_ids[: -(-state.num_computed_tokens // self.runner.block_size)]
        for result in emitted:
            _emit(state, result, response)


def _emit(state: RequestState, result: SampledToken, response: shard_pb2.StepResponse) -> shard_pb2.Generation:
    """Appends a generated token to the request and reports it."""
    state.token_ids.append(result.token_id)
    gen = response.generations.add(id=state.id, token_id=result.token_id)
    if state.params.logprobs or state.params.top_n_tokens:
        gen.logprob = result.logprob
        for token_id, logprob in result.top_tokens:
            gen.top_tokens.add(token_id=token_id, logprob=logprob)
    return gen


class ModelThread:
    """The one thread that does the shard's torch work: loading, warmup,
    steps, probes.

    torch runs the parallel regions of its CPU ops (and of our kernels) on
    OpenMP, and libgomp keeps a team of worker threads for each thread that
    starts a region. A second thread doing model work (asyncio.to_thread hands
    each call to whichever pool thread is free, and the model was loaded on
    the main thread) makes a second team. With more OpenMP threads than cores
    libgomp stops spinning between regions, so each of a decode step's ~200
    regions wakes its workers through the kernel. Measured on 2 cores, one
    sequence's decode step: 6.7 ms with every call on one thread, 26-30 ms
    once a second thread had run one. Also per thread under OpenMP: the
    thread count torch.set_num_threads sets, and the current CUDA device.
    """

    def __init__(self, num_threads: int = 0):
        self.executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="sluice-model", initializer=_init_model_thread, initargs=(num_threads,)
        )

    def run(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """fn(*args) on the model thread, after every call submitted before."""
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False)


def _init_model_thread(num_threads: int) -> None:
    # Named for the OS too, so that top -H and /proc/PID/task show it.
    try:
        ctypes.CDLL(None).prctl(15, b"sluice-model", 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux
        pass
    if num_threads > 0:
        import torch

        torch.set_num_threads(num_threads)


class ShardServicer(shard_pb2_grpc.ShardServicer):
    """`fatal` is called (once) when the shard cannot go on: with several
    ranks, a model call that failed past validation may have left this rank's
    collectives out of step with the others', so the only safe move is to end
    the whole group (the process exits non-zero, the launcher stops the rest).
    """

    def __init__(
        self, shard: Shard, fatal: Callable[[str], None] = lambda reason: None, model_thread: ModelThread | None = None
    ):
        self.shard = shard
        self.fatal = fatal
        self.model_thread = model_thread or ModelThread()
        # One model call at a time: steps, warmup and health probes share the
        # cache and, with several ranks, the order of the collectives. The
        # lock is held until the worker thread is done, even when the caller
        # went away (see `_finish`).
        self.lock = asyncio.Lock()

    async def _run(self, context, fn, *args):
        async with self.lock:
            try:
                return await _finish(self.model_thread.run(fn, *args))
            except InvalidStep as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except (NotWarmedUp, SlotInUse) as e:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except KVBudgetError as e:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
            except ValueError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            except Exception as e:  # noqa: BLE001 - the server keeps serving
                name = getattr(fn, "__name__", fn)
                log.exception("%s failed", name)
                if self.shard.runner.dist.is_parallel:
                    self.fatal(f"{name} failed on a tensor-parallel rank: {type(e).__name__}: {e}")
                await context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    async def Info(self, request, context):
        return self.shard.info()

    async def Health(self, request, context):
        await self._run(context, self.shard.health_check)
        return shard_pb2.HealthResponse()

    async def ServiceDiscovery(self, request, context):
        return shard_pb2.ServiceDiscoveryResponse(urls=self.shard.urls)

    async def Warmup(self, request, context):
        return await self._run(context, self.shard.warmup, request)

    async def Step(self, request, context):
        with telemetry.step_span(context.invocation_metadata(), request) as span:
            response = await self._run(context, self.shard.step, request)
            telemetry.record_step(span, response)
            return response

    async def LoadAdapter(self, request, context):
        return await self._run(context, self.shard.load_adapter, request)

    async def UnloadAdapter(self, request, context):
        return await self._run(context, self.shard.unload_adapter, request)

    async def ClearCache(self, request, context):
        async with self.lock:
            self.shard.clear()
        return shard_pb2.ClearCacheResponse()


async def _finish(work: asyncio.Future):
    """Awaits `work` (a model call on a worker thread) to its end.

    grpc.aio cancels a handler whose caller went away (the router drops the
    other ranks' calls when one rank fails). The thread cannot be stopped and
    may be inside a collective; letting the cancellation through would
    release the model lock while it runs, and the next Step would then share
    the KV cache with it and issue its collectives out of order. So the
    cancellation waits for the thread, then propagates.
    """
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(work)
            break
        except asyncio.CancelledError:
            if work.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
