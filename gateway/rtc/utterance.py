"""One `speak` id of a session: its text (possibly still arriving), its voice, and what became of it."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from gateway.orpheus import SentenceSplitter
from gateway.speech.synthesizer import UtteranceStats


@dataclass(eq=False)
class Utterance:
    """Sentences come out of `sentence_stream` as soon as they are complete, so synthesis can start while the
    client is still writing (`more: true` pieces)."""

    id: str
    voice: str
    received_at: float  # the speak message, for time to first audio
    splitter: SentenceSplitter
    sentences: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    text_chars: int = 0
    closed: bool = False  # all its text has arrived
    cancelled: bool = False
    stats: UtteranceStats | None = None

    def add_text(self, text: str, more: bool) -> None:
        self.text_chars += len(text)
        for sentence in self.splitter.feed(text):
            self.sentences.put_nowait(sentence)
        if not more:
            for sentence in self.splitter.flush():
                self.sentences.put_nowait(sentence)
            self.sentences.put_nowait(None)
            self.closed = True

    async def sentence_stream(self) -> AsyncIterator[str]:
        while (sentence := await self.sentences.get()) is not None:
            yield sentence
