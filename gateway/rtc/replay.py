"""A session's recordings of what it said, and plans to say (part of) one again: the `repeat` message.

Each utterance whose audio was made to the end is kept as a `Recording`: its text as the client sent it, and per
sentence the PCM as synthesised (24 kHz, rate 1) with its word timings. `ReplayCache` keeps the newest ones within
two bounds: at most `max_utterances` recordings and `max_seconds` of audio together (config
`replay_cache_utterances`, default 8, and `replay_cache_s`, default 60 s = 2.9 MB of int16 per session); older
ones are evicted first, and one longer than `max_seconds` alone is not kept. `plan()` cuts a word range out of a
recording (each sentence's audio from just before its first word in the range to just after its last one), with
the timings moved onto the cut, so a repeat needs no engine request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from gateway.orpheus import SAMPLE_RATE
from gateway.rtc.timings import SentenceTimings

# Audio kept around a cut word range (never past the neighbouring words): a word's onset and release sit a
# little outside the span the timings give it.
CUT_PAD_MS = 80


@dataclass(eq=False)
class Sentence:
    """One sentence (or cut piece of one) of an utterance: `text` as its `segment` shows it, `char_start`..
    `char_end` its span in the utterance's text, `first_word` the utterance index of its first word, `pcm` its audio
    as synthesised (None until complete), `timings` its words (offsets into the utterance's text) and visemes."""

    index: int
    text: str
    char_start: int
    char_end: int
    first_word: int
    word_count: int
    pcm: np.ndarray | None = None
    timings: SentenceTimings | None = None
    language: str | None = None  # espeak-ng: a mixed-language span's own; None: its utterance's

    @property
    def audio_ms(self) -> float:
        return 0.0 if self.pcm is None else len(self.pcm) * 1000 / SAMPLE_RATE


@dataclass(eq=False)
class Recording:
    """An utterance whose audio was made to the end."""

    id: str
    text: str
    voice: str
    language: str
    sentences: list[Sentence] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        return sum(0 if s.pcm is None else len(s.pcm) for s in self.sentences) / SAMPLE_RATE

    @property
    def word_count(self) -> int:
        return sum(s.word_count for s in self.sentences)


class ReplayCache:
    """The newest recordings of one session, bounded by count and by seconds of audio."""

    def __init__(self, max_utterances: int, max_seconds: float) -> None:
        self.max_utterances = max_utterances
        self.max_seconds = max_seconds
        self._recordings: OrderedDict[str, Recording] = OrderedDict()
        self.seconds = 0.0

    def __len__(self) -> int:
        return len(self._recordings)

    def put(self, recording: Recording) -> bool:
        """Keep `recording` (replacing one of the same id), evicting the oldest ones beyond the bounds."""
        seconds = recording.seconds
        if self.max_utterances <= 0 or seconds > self.max_seconds:
            return False
        self.pop(recording.id)
        self._recordings[recording.id] = recording
        self.seconds += seconds
        while len(self._recordings) > self.max_utterances or self.seconds > self.max_seconds:
            self.pop(next(iter(self._recordings)))
        return True

    def get(self, utterance_id: str) -> Recording | None:
        return self._recordings.get(utterance_id)

    def pop(self, utterance_id: str) -> Recording | None:
        recording = self._recordings.pop(utterance_id, None)
        if recording is not None:
            self.seconds -= recording.seconds
        return recording


def plan(recording: Recording, from_word: int | None, to_word: int | None,
         timings_of: Callable[[Sentence], SentenceTimings]) -> tuple[list[Sentence], int]:
    """The pieces to play for words `from_word`..`to_word` (inclusive; None: from the start / to the end) of
    `recording`, and where the repeated text starts in its text. Whole sentences when no range is given.
    `timings_of` gives a sentence's timings (made now if they were not made yet). ValueError for a bad range."""
    total = recording.word_count
    if from_word is None and to_word is None:
        return list(recording.sentences), 0
    first = 0 if from_word is None else from_word
    last = total - 1 if to_word is None else to_word
    if not 0 <= first <= last < total:
        raise ValueError(f"word range {from_word}..{to_word} is outside utterance {recording.id!r}, which has "
                         f"{total} words (0..{total - 1})")
    pieces: list[Sentence] = []
    text_start = -1
    for sentence in recording.sentences:
        lo = max(first, sentence.first_word) - sentence.first_word
        hi = min(last, sentence.first_word + sentence.word_count - 1) - sentence.first_word
        if lo > hi or sentence.pcm is None:
            continue
        piece = _cut(recording.text, sentence, timings_of(sentence), lo, hi, len(pieces))
        if text_start < 0:
            text_start = piece.char_start
        pieces.append(piece)
    return pieces, max(0, text_start)


def _cut(text: str, sentence: Sentence, timings: SentenceTimings, lo: int, hi: int, index: int) -> Sentence:
    """Words `lo`..`hi` of one sentence (its own word indices) as a piece of its own."""
    assert sentence.pcm is not None
    words = timings.words
    audio_ms = sentence.audio_ms
    start_ms = max(words[lo - 1].end_ms if lo > 0 else 0.0, words[lo].start_ms - CUT_PAD_MS)
    end_ms = min(words[hi + 1].start_ms if hi + 1 < len(words) else audio_ms, words[hi].end_ms + CUT_PAD_MS)
    start = int(start_ms * SAMPLE_RATE / 1000)
    end = max(start, int(end_ms * SAMPLE_RATE / 1000))
    shift = start * 1000 / SAMPLE_RATE
    kept = [replace(w, start_ms=max(0, round(w.start_ms - shift))) for w in words[lo:hi + 1]]
    visemes = [replace(v, start_ms=max(0, round(v.start_ms - shift)), word_index=v.word_index - lo)
               for v in timings.visemes if lo <= v.word_index <= hi]
    char_start, char_end = words[lo].char_start, words[hi].char_end
    return Sentence(index=index, text=text[char_start:char_end], char_start=char_start, char_end=char_end,
                    first_word=sentence.first_word + lo, word_count=hi - lo + 1, pcm=sentence.pcm[start:end],
                    timings=SentenceTimings(kept, visemes, timings.source))
