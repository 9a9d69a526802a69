"""The app's state: built once by `create_app`, handed to the routes through the app (`GATEWAY_KEY`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Callable

import numpy as np
from aiohttp import web

from gateway.config import GatewayConfig
from gateway.edge.auth import AccessPolicy
from gateway.phrases.cache import PhraseCache, Timings
from gateway.rtc.manager import SessionManager
from gateway.rtc.services import SessionServices
from gateway.rtc.timings import timing_service
from gateway.service.admission import Admission, StreamCounts
from gateway.service.loop_lag import LoopLagMonitor
from gateway.service.metrics import Metrics
from gateway.speech.engine import EngineState
from gateway.speech.synthesizer import Synthesizer

log = logging.getLogger(__name__)

MAX_FAILURE_CHARS = 500
GC_GEN0_THRESHOLD = 50_000  # young-generation collections are cheap; rare ones avoid stream-wide stalls


class GatewayState:
    """Configuration, metrics, admission, access, the synthesizer (and its one engine) and the sessions."""

    def __init__(self, config: GatewayConfig, synthesizer: Synthesizer | None = None,
                 session_id_prefix: str = "", stream_counts: StreamCounts | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.synthesizer = synthesizer
        self.session_id_prefix = session_id_prefix  # `w<index>-` in a worker process: who owns a session
        self.admission = Admission.from_config(config, stream_counts)  # counts: every worker's utterances
        self.access = AccessPolicy.from_lists(config.auth_token, config.auth_secret, config.allowed_origin)
        # The phrase cache (None when off): hits carry the word timings the sessions' timing service made.
        self.phrases = PhraseCache.from_config(config, self.metrics.phrases, self.admission, self._phrase_timings)
        self.sessions = SessionManager(
            SessionServices(config, self.metrics, self.admission, self._speaking_synthesizer, self.phrases),
            session_id_prefix)
        self._owns_synthesizer = synthesizer is None
        self._start_task: asyncio.Task[None] | None = None
        self.loop_lag = LoopLagMonitor(self.metrics.loop_lag_seconds.observe)  # runs from startup to cleanup
        self.failure: str | None = None  # why the engine could not start: /readyz says so
        self.on_failure: Callable[[str], None] | None = None  # `serve` exits non-zero on it

    def _speaking_synthesizer(self) -> Synthesizer | None:
        """The synthesizer once sessions may speak through it: loaded, and its SNAC decoder reachable (until then
        a `speak` is refused as "still starting", with a retry hint)."""
        synthesizer = self.synthesizer
        return synthesizer if synthesizer is not None and synthesizer.decoder_ready else None

    async def _phrase_timings(self, text: str, pcm: np.ndarray, language: str) -> Timings:
        timings = await timing_service(self.config.aligner_model).sentence(text, pcm, language)
        return Timings(timings.words, timings.visemes, timings.source)

    @property
    def ready(self) -> bool:
        return self.synthesizer is not None and self.synthesizer.ready

    def _on_engine_state(self, state: EngineState) -> None:
        synthesizer = self.synthesizer
        engines = [] if synthesizer is None else list(synthesizer.engines.values())
        self.metrics.engine_ready.set(1 if engines and all(engine.ready for engine in engines) else 0)
        if state is EngineState.READY and any(engine.restarts for engine in engines):
            self.metrics.engine_restarts_total.inc()

    async def startup(self, app: web.Application) -> None:
        self.loop_lag.start()
        if self.synthesizer is None:
            # Health answers at once; readiness waits for the engine, which loads in the background.
            self._start_task = asyncio.create_task(self._load_and_start())
        else:
            self._attach(self.synthesizer)

    def _attach(self, synthesizer: Synthesizer) -> None:
        self.metrics.snac.watch(synthesizer.decoder)
        for engine in synthesizer.engines.values():
            engine.on_state = self._on_engine_state
        self.metrics.track_in_flight(lambda: sum(engine.in_flight for engine in synthesizer.engines.values()))
        self.metrics.engine_ready.set(1 if all(engine.ready for engine in synthesizer.engines.values()) else 0)
        if synthesizer.table.several:
            self.metrics.track_models(synthesizer.model_stats)

    async def _load_and_start(self) -> None:
        try:
            synthesizer = await asyncio.to_thread(Synthesizer.load, self.config)
            self.synthesizer = synthesizer
            self._attach(synthesizer)
            await synthesizer.start()
        except Exception as exc:
            self.failure = f"{type(exc).__name__}: {exc}".splitlines()[0][:MAX_FAILURE_CHARS]
            log.exception("could not start the speech engine")
            log.error("the speech engine cannot start: %s", self.failure)
            if self.on_failure is not None:
                self.on_failure(self.failure)
            return
        if self.config.gc_freeze:
            freeze_startup_objects()

    async def cleanup(self, app: web.Application) -> None:
        await self.loop_lag.stop()
        await self.sessions.close_all()
        if self._start_task is not None and not self._start_task.done():
            self._start_task.cancel()
            with contextlib.suppress(BaseException):
                await self._start_task
        if self.phrases is not None:
            await self.phrases.close()
        if self._owns_synthesizer and self.synthesizer is not None:
            await self.synthesizer.close()


def freeze_startup_objects() -> None:
    """Keep the garbage collector from pausing every stream at once (measured: 0.4-0.6 s stalls at N>=256).

    Objects alive after start-up (model, engine client, modules) move to the permanent generation, and the
    young generation is collected less often, so a full collection rarely has much to walk.
    """
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, gen1, gen2)
