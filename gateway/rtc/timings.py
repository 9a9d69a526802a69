"""Word timings and visemes of one sentence's audio, made off the event loop, for every session of a process.

`TimingService` (one per process and aligner checkpoint, `timing_service()`) turns a sentence's text and PCM into
`SentenceTimings`: words from `gateway.timing.estimate_word_timings` (model-free, ~0.2 ms of CPU per second of
audio) or, with `aligner_model` configured, from `gateway.timing.CtcAligner` (CTC forced alignment), and the
visemes of those words (`visemes_for_words`). Both run in threads: estimation in the default executor (it costs
~1 ms per sentence, more the first time espeak-ng meets a word), alignment in one dedicated worker thread with one
torch thread, because a real checkpoint costs 145-400 ms of CPU per second of audio on a CPU (docs/lesson.md):
one sentence at a time, and whenever that worker is busy, or does not answer within `ALIGN_TIMEOUT_S`, the sentence
gets estimated timings instead, so the aligner can never fall behind the speech.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from dataclasses import dataclass

import numpy as np

from gateway.orpheus import SAMPLE_RATE
from gateway.timing import CtcAligner, VisemeTiming, WordTiming, estimate_word_timings, visemes_for_words

log = logging.getLogger(__name__)

ALIGNED = "aligned"
ESTIMATED = "estimated"
# An aligned result later than this after the sentence's audio is complete is not waited for: the words of a
# sentence are due when it starts playing, and estimated ones are better than late ones.
ALIGN_TIMEOUT_S = 0.5


@dataclass(frozen=True)
class SentenceTimings:
    """A sentence's words (character offsets into the text given, ms from the sentence's first sample, as made at
    rate 1) and visemes (same clock; `word_index` indexes `words`); `source`: "aligned" or "estimated"."""

    words: list[WordTiming]
    visemes: list[VisemeTiming]
    source: str


def estimate(text: str, pcm: np.ndarray, language: str) -> SentenceTimings:
    """Estimated timings (no model): costs ~1 ms of CPU for a few seconds of audio."""
    words = estimate_word_timings(text, pcm, SAMPLE_RATE, language)
    return SentenceTimings(words, _visemes(words, language), ESTIMATED)


_warned_languages: set[str] = set()


def _visemes(words: list[WordTiming], language: str) -> list[VisemeTiming]:
    """Visemes of the words; none (amplitude drives the mouth) if the G2P cannot do this language."""
    try:
        return visemes_for_words(words, language)
    except Exception as exc:  # e.g. a language espeak-ng does not know: timings still go out
        if language not in _warned_languages:
            _warned_languages.add(language)
            log.warning("no visemes for language %r: %s", language, exc)
        return []


def _one_torch_thread() -> None:
    """The aligner's worker uses one core: torch's intra-op threads are set per calling thread."""
    import torch

    torch.set_num_threads(1)


class TimingService:
    """Makes `SentenceTimings`; with an aligner checkpoint, loads it once (in its worker thread, at creation) and
    aligns one sentence at a time there."""

    def __init__(self, aligner_model: str | None = None) -> None:
        self.aligner_model = aligner_model
        self._aligner: CtcAligner | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._busy = threading.Event()  # set while the worker loads or aligns: callers estimate meanwhile
        if aligner_model:
            self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aligner",
                                                                   initializer=_one_torch_thread)
            self._busy.set()
            self._executor.submit(self._load)

    @property
    def aligner_ready(self) -> bool:
        return self._aligner is not None

    def _load(self) -> None:
        try:
            self._aligner = CtcAligner.load(self.aligner_model)  # type: ignore[arg-type]
            log.info("word aligner %s loaded", self.aligner_model)
        except Exception:
            log.exception("the word aligner %s could not be loaded; word timings are estimated", self.aligner_model)
        finally:
            self._busy.clear()

    def _align(self, text: str, pcm: np.ndarray, language: str) -> SentenceTimings:
        assert self._aligner is not None
        words = self._aligner.align(text, pcm, SAMPLE_RATE, language)
        # align() estimates by itself when no CTC path exists (text far longer than its audio).
        source = ALIGNED if words and all(w.source == ALIGNED for w in words) else ESTIMATED
        return SentenceTimings(words, _visemes(words, language), source)

    async def sentence(self, text: str, pcm: np.ndarray, language: str) -> SentenceTimings:
        """Timings of one sentence: aligned when the aligner is free and answers in time, else estimated."""
        if self._aligner is not None and self._executor is not None and not self._busy.is_set():
            self._busy.set()
            future = self._executor.submit(self._align, text, pcm, language)
            future.add_done_callback(lambda _: self._busy.clear())
            result = asyncio.wrap_future(future)
            result.add_done_callback(_retrieve)  # a result nobody waits for any more must not warn when it fails
            try:
                # shield: a timeout must not cancel the thread's future (it runs on, keeping the worker busy).
                return await asyncio.wait_for(asyncio.shield(result), ALIGN_TIMEOUT_S)
            except TimeoutError:
                log.debug("alignment later than %.1f s; estimating", ALIGN_TIMEOUT_S)
            except Exception:
                log.warning("alignment failed; estimating", exc_info=True)
        return await asyncio.to_thread(estimate, text, pcm, language)


def _retrieve(future: asyncio.Future[SentenceTimings]) -> None:
    if not future.cancelled():
        future.exception()


_services: dict[str | None, TimingService] = {}


def timing_service(aligner_model: str | None) -> TimingService:
    """The process's service for this aligner checkpoint (None: estimated timings only), made on first use."""
    service = _services.get(aligner_model)
    if service is None:
        service = _services[aligner_model] = TimingService(aligner_model)
    return service
