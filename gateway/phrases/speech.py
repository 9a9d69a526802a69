"""An utterance's sentences as audio through the phrase cache: each sentence a hit (its stored audio at once, no
engine request) or a miss (made by a single flight, which it may share with other requests for the same line).

`cached_sentences` yields the synthesizer's `AudioChunk`s, so its callers treat both alike; a hit's chunk is a
`CachedChunk` carrying its entry (the stored word timings and visemes). Sentence k+1 is looked up once sentence
k's audio is complete, as the synthesizer starts a sentence's generation once the previous one's is done. A
`VoicedSentence` (a span of mixed-language text) is keyed and made by its own voice, so by its own model.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable
from dataclasses import dataclass

from gateway.phrases.cache import PhraseCache
from gateway.phrases.entry import PhraseEntry
from gateway.speech.synthesizer import AudioChunk, Synthesizer, UtteranceStats, aiter_of
from gateway.speech.utterance_text import VoicedSentence


@dataclass
class CachedChunk(AudioChunk):
    """A hit: the sentence's whole stored audio in one chunk, with its entry."""

    entry: PhraseEntry | None = None


async def cached_sentences(cache: PhraseCache, synthesizer: Synthesizer,
                           sentences: Iterable[str | VoicedSentence] | AsyncIterable[str | VoicedSentence],
                           voice: str, *, stats: UtteranceStats, seed: int | None = None) -> AsyncIterator[AudioChunk]:
    """Audio chunks of `sentences` (already split; a `VoicedSentence` by its own voice), hits from the cache and
    misses from single flights; `stats` gets first audio, first token and window (as they reached this request: see
    `reached`; none when the first sentence was a hit) and the tokens of the flights this request led or
    followed."""
    index = 0
    async for raw in aiter_of(sentences):
        text, sentence_voice = (raw.text, raw.voice) if isinstance(raw, VoicedSentence) else (raw, voice)
        sentence = text.strip()
        if not sentence:
            continue
        key = cache.key(sentence_voice, sentence, seed)
        running = cache.flights.get(key.digest)
        if running is None:
            entry = await cache.lookup(key)
        else:  # a finished flight is a hit while its entry is being stored
            entry = running.entry if running.done else None
        if entry is not None:
            cache.metrics.hits_total.inc()
            if stats.first_audio_at is None:
                stats.first_audio_at = time.monotonic()
            stats.samples += len(entry.pcm)
            yield CachedChunk(entry.pcm, index, sentence, True, True, entry=entry)
        else:
            if key.digest not in cache.flights:
                cache.metrics.misses_total.inc()
            flight = cache.flight(key, synthesizer)
            first = True
            async for pcm, last in cache.follow(flight, stats.playout_lead_s):
                if stats.first_audio_at is None:
                    stats.first_audio_at = now = time.monotonic()
                    stats.first_token_at = reached(flight.stats.first_token_at, stats.started, now)
                    stats.first_window_at = max(reached(flight.stats.first_window_at, stats.started, now),
                                                stats.first_token_at)
                stats.samples += len(pcm)
                yield AudioChunk(pcm, index, sentence, first, last)
                first = False
            stats.tokens += flight.take_tokens()
        index += 1
        stats.sentences = index
    stats.finished_at = time.monotonic()


def reached(at: float | None, since: float, now: float) -> float:
    """When a flight's first token (or window) reached a request that started at `since` and got the flight's
    first audio `now`: the flight's own time where this process made it after the request came; `now` where it was
    made before (the request joined late) or elsewhere (its audio came through the board, no tokens here)."""
    return at if at is not None and at >= since else now
