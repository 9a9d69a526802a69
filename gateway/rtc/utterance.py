"""One `speak` (or `repeat`) id of a session: its text (possibly still arriving) and where each sentence of it
came from in that text, its voice and rate, and what became of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gateway.model_table import espeak_language
from gateway.orpheus import SentenceSplitter, split_sentences
from gateway.speech.language_spans import LanguageSpan
from gateway.speech.synthesizer import UtteranceStats
from gateway.speech.utterance_text import VoicedSentence

if TYPE_CHECKING:
    from gateway.rtc.replay import Sentence


@dataclass(eq=False)
class ReplayPlan:
    """A repeat: the recorded pieces to play, and where the repeated words start in the text (for `heard_text`)."""

    pieces: list[Sentence]
    text_start: int = 0


@dataclass(eq=False)
class Utterance:
    """Sentences come out of `sentence_stream` as soon as they are complete, so synthesis can start while the
    client is still writing (`more: true` pieces). `text` is everything the client sent for it, as sent; `spans[k]`
    is where sentence k came from in it (the splitter normalises whitespace, so the sentence itself is no offset)."""

    id: str
    voice: str
    received_at: float  # the speak message, for time to first audio
    splitter: SentenceSplitter = field(default_factory=SentenceSplitter)
    sentences: asyncio.Queue[str | VoicedSentence | None] = field(default_factory=asyncio.Queue)
    text_chars: int = 0
    closed: bool = False  # all its text has arrived
    cancelled: bool = False
    stats: UtteranceStats | None = None
    rate: float = 1.0  # playback rate (pitch kept)
    text: str = ""
    spans: list[tuple[int, int]] = field(default_factory=list)
    # Mixed-language text (`add_spans`): sentence k's espeak-ng language where its span names one, else None.
    languages: list[str | None] = field(default_factory=list)
    replay: ReplayPlan | None = None  # set for a repeat: played from a recording, no engine request
    cache: bool | None = None  # `speak`'s `cache`: true a scripted line, false a private one, None not said
    _cursor: int = 0  # where the next sentence's search starts in `text`

    def add_text(self, text: str, more: bool) -> None:
        self.text_chars += len(text)
        self.text += text
        for sentence in self.splitter.feed(text):
            self._put(sentence)
        if not more:
            for sentence in self.splitter.flush():
                self._put(sentence)
            self.sentences.put_nowait(None)
            self.closed = True

    def add_spans(self, text: str, spans: list[tuple[LanguageSpan, str]], max_sentence_chars: int) -> None:
        """The whole text of a mixed-language utterance: each span's sentences by the span's voice (a sentence of
        another voice than the utterance's goes out as a `VoicedSentence`), located in the text as sent."""
        self.text_chars += len(text)
        self.text += text
        for span, voice in spans:
            self._cursor = max(self._cursor, span.start)
            language = None if span.language is None else espeak_language(span.language)
            for sentence in split_sentences(text[span.start:span.end], max_sentence_chars):
                self._put(sentence if voice == self.voice else VoicedSentence(sentence, voice), language)
        self.sentences.put_nowait(None)
        self.closed = True

    def _put(self, sentence: str | VoicedSentence, language: str | None = None) -> None:
        text = sentence.text if isinstance(sentence, VoicedSentence) else sentence
        start, end = locate(self.text, text, self._cursor)
        self._cursor = end
        self.spans.append((start, end))
        self.languages.append(language)
        self.sentences.put_nowait(sentence)

    async def sentence_stream(self) -> AsyncIterator[str | VoicedSentence]:
        while (sentence := await self.sentences.get()) is not None:
            yield sentence


def locate(text: str, sentence: str, start: int = 0) -> tuple[int, int]:
    """Where `sentence` came from in `text`, searching from `start`: the splitter only collapses, strips and cuts
    at whitespace, so the sentence's non-space characters are the next non-space characters of `text`."""
    pos, first, end = start, -1, start
    for char in sentence:
        if char.isspace():
            continue
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos >= len(text) or text[pos] != char:  # not expected; resynchronise on the next occurrence
            found = text.find(char, pos)
            if found < 0:
                break
            pos = found
        if first < 0:
            first = pos
        pos += 1
        end = pos
    return (first, end) if first >= 0 else (start, start)
