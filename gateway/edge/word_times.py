"""Word timings of a stream of audio chunks, on that stream's own clock: for the doors that send audio as raw
bytes (the speech route's SSE, the streaming WebSocket), where no RTP clock or playout marks the sentences.

`WordClock.add(chunk)` keeps each sentence's PCM as it comes; once the sentence's audio is complete it returns the
sentence's words (`gateway.rtc.timings.TimingService`: aligned or estimated, as configured) in seconds from the
stream's first sample. Owns `WordClock` and `TimedWord`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.config import GatewayConfig
from gateway.orpheus import SAMPLE_RATE
from gateway.rtc.timings import timing_service
from gateway.speech.synthesizer import AudioChunk


@dataclass(frozen=True)
class TimedWord:
    """A word and where it is heard, in seconds from the stream's first sample."""

    text: str
    start_s: float
    end_s: float


class WordClock:
    """Word timings of one stream's chunks, sentence by sentence; `rate` > 1 plays them faster (times / rate)."""

    def __init__(self, config: GatewayConfig, voice: str, rate: float = 1.0) -> None:
        self.timings = timing_service(config.aligner_model)
        self.language = config.language_of(voice)
        self.rate = rate
        self.samples = 0  # 24 kHz samples of the stream so far (as made, before any rate change)
        self._sentence_start = 0
        self._pieces: list[np.ndarray] = []

    async def add(self, chunk: AudioChunk) -> list[TimedWord]:
        """Count `chunk` in; the words of its sentence when this chunk completes it, else none."""
        if chunk.first_of_sentence:
            self._sentence_start, self._pieces = self.samples, []
        self.samples += len(chunk.pcm)
        self._pieces.append(chunk.pcm)
        if not chunk.last_of_sentence:
            return []
        pcm = np.concatenate(self._pieces)
        self._pieces = []
        made = await self.timings.sentence(chunk.sentence_text, pcm, self.language)
        offset_s = self._sentence_start / SAMPLE_RATE
        return [TimedWord(w.text, (offset_s + w.start_ms / 1000) / self.rate, (offset_s + w.end_ms / 1000) / self.rate)
                for w in made.words]
