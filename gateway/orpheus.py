"""Everything that is specific to Orpheus: special ids, voices, the prompt format, sentence splitting and
the parsing of generated ids into SNAC frames.

Token facts (canopyai/Orpheus-TTS): audio token k of an utterance has id
`AUDIO_TOKEN_BASE + CODEBOOK_SIZE * (k % 7) + code`; seven consecutive tokens make one SNAC frame whose
codes go to the codec's three layers as L0=[c0], L1=[c1, c4], L2=[c2, c3, c5, c6].
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

BOS_ID = 128000
END_OF_TEXT_ID = 128009
START_OF_SPEECH_ID = 128257
END_OF_SPEECH_ID = 128258  # the stop id
START_OF_HUMAN_ID = 128259
END_OF_HUMAN_ID = 128260
START_OF_AI_ID = 128261
AUDIO_TOKEN_BASE = 128266
CODEBOOK_SIZE = 4096
SLOTS_PER_FRAME = 7
AUDIO_TOKEN_END = AUDIO_TOKEN_BASE + SLOTS_PER_FRAME * CODEBOOK_SIZE  # exclusive

PROMPT_PREFIX = (START_OF_HUMAN_ID,)
PROMPT_SUFFIX = (END_OF_TEXT_ID, END_OF_HUMAN_ID, START_OF_AI_ID, START_OF_SPEECH_ID)

SAMPLE_RATE = 24000
SAMPLES_PER_FRAME = 2048  # one SNAC frame = 85.3 ms at 24 kHz
AUDIO_TOKENS_PER_SECOND = SLOTS_PER_FRAME * SAMPLE_RATE / SAMPLES_PER_FRAME  # 82.03: one real-time stream

EMOTIVE_TAGS = ("<laugh>", "<chuckle>", "<sigh>", "<cough>", "<sniffle>", "<groan>", "<yawn>", "<gasp>")

ENGLISH_VOICES = ["tara", "leah", "jess", "leo", "dan", "mia", "zac", "zoe"]
# Multilingual research releases: canopylabs/3b-{lang}-ft-research_release.
MULTILINGUAL_VOICES: dict[str, list[str]] = {
    "fr": ["pierre", "amelie", "marie"],
    "de": ["jana", "thomas", "max"],
    "ko": ["유나", "준서"],
    "hi": ["ऋतिका"],
    "zh": ["长乐", "白芷"],
    "es_it": ["javi", "sergio", "maria", "pietro", "giulia", "carlo"],
}


def voices_for_model(model: str) -> list[str]:
    """The voices a checkpoint was trained with, recognised from its name; English ones otherwise."""
    name = model.rstrip("/").rsplit("/", 1)[-1].lower()
    for lang, voices in MULTILINGUAL_VOICES.items():
        if re.search(rf"(^|[-_]){re.escape(lang)}([-_]|$)", name):
            return list(voices)
    return list(ENGLISH_VOICES)


# The language each voice was trained to speak, as espeak-ng names it (visemes, word timings).
_VOICE_LANGUAGES: dict[str, str] = {
    **{voice: "en-us" for voice in ENGLISH_VOICES},
    **{voice: "fr-fr" for voice in MULTILINGUAL_VOICES["fr"]},
    **{voice: "de" for voice in MULTILINGUAL_VOICES["de"]},
    **{voice: "ko" for voice in MULTILINGUAL_VOICES["ko"]},
    **{voice: "hi" for voice in MULTILINGUAL_VOICES["hi"]},
    **{voice: "cmn" for voice in MULTILINGUAL_VOICES["zh"]},
    **dict.fromkeys(("javi", "sergio", "maria"), "es"),
    **dict.fromkeys(("pietro", "giulia", "carlo"), "it"),
}


def language_for_voice(voice: str) -> str:
    """The language a voice speaks (espeak-ng name); en-us for a voice we do not know."""
    return _VOICE_LANGUAGES.get(voice, "en-us")


class TextTokenizer(Protocol):
    bos_token_id: int | None

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def build_prompt(tokenizer: TextTokenizer, voice: str, text: str) -> list[int]:
    """`[SOH] BOS tokens("{voice}: {text}") [EOT, EOH, SOA, SOS]` -- the format Orpheus was tuned on.

    BOS is added here rather than by the tokenizer's post-processor so the prompt does not depend on
    how a checkpoint's tokenizer happens to be configured. Emotive tags pass through as plain text.
    """
    ids = tokenizer.encode(f"{voice}: {text}", add_special_tokens=False)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else [BOS_ID]
    return [*PROMPT_PREFIX, *bos, *ids, *PROMPT_SUFFIX]


# --- sentences ---------------------------------------------------------------------------------------

# A boundary: terminal punctuation (optionally closed by quotes/brackets) followed by whitespace, or CJK
# full-width terminal punctuation, or a blank line. Decimals ("3.5") and "e.g.x" have no space after.
_BOUNDARY = re.compile(r"(?:[.!?…]+[\"'”’)\]]*(?=\s)|[。！？]+[」』”’）]*|\n\s*\n)")
_SOFT_BREAK = re.compile(r"[,;:，；、]\s")
_ABBREVIATIONS = {"mr.", "mrs.", "ms.", "dr.", "prof.", "sr.", "sra.", "st.", "e.g.", "i.e.", "etc.", "vs."}


def _is_abbreviation(text: str, end: int) -> bool:
    start = text.rfind(" ", 0, end) + 1
    return text[start:end].lower() in _ABBREVIATIONS


def _split_long(sentence: str, max_chars: int) -> list[str]:
    """Split a sentence longer than max_chars at commas, else at spaces, else hard."""
    pieces: list[str] = []
    rest = sentence
    while len(rest) > max_chars:
        window = rest[:max_chars]
        cut = max((m.end() for m in _SOFT_BREAK.finditer(window)), default=0)
        if cut < max_chars // 3:
            cut = window.rfind(" ") + 1
        if cut <= 0:
            cut = max_chars
        pieces.append(rest[:cut].strip())
        rest = rest[cut:]
    if rest.strip():
        pieces.append(rest.strip())
    return [p for p in pieces if p]


class SentenceSplitter:
    """Incremental sentence splitter: text arrives in pieces (an LLM writing the lesson), sentences come
    out as soon as they are known to be complete, and `flush()` returns the rest."""

    def __init__(self, max_sentence_chars: int = 300) -> None:
        self._max_chars = max_sentence_chars
        self._buffer = ""

    def feed(self, text: str) -> list[str]:
        self._buffer += text
        out: list[str] = []
        start = 0
        for match in _BOUNDARY.finditer(self._buffer):
            if match.group().startswith(".") and _is_abbreviation(self._buffer, match.end()):
                continue
            out.extend(self._emit(self._buffer[start:match.end()]))
            start = match.end()
        self._buffer = self._buffer[start:]
        # A sentence that keeps growing without punctuation is cut at a soft break once it is too long.
        if len(self._buffer) > self._max_chars:
            pieces = _split_long(self._buffer, self._max_chars)
            out.extend(pieces[:-1])
            self._buffer = pieces[-1] if pieces else ""
        return out

    def flush(self) -> list[str]:
        rest, self._buffer = self._buffer, ""
        return self._emit(rest)

    def _emit(self, sentence: str) -> list[str]:
        sentence = " ".join(sentence.split())
        if not sentence:
            return []
        return _split_long(sentence, self._max_chars)


def split_sentences(text: str, max_sentence_chars: int = 300) -> list[str]:
    splitter = SentenceSplitter(max_sentence_chars)
    return splitter.feed(text) + splitter.flush()


def sentence_token_cap(chars: int, tokens_per_char: float, max_tokens: int) -> int:
    """Most audio tokens to generate for a sentence of `chars` characters: `max_tokens`, and with
    `tokens_per_char` > 0 also that many per character, in whole frames (at least one frame)."""
    whole = max_tokens - max_tokens % SLOTS_PER_FRAME
    if tokens_per_char <= 0:
        return whole
    frames = max(1, math.ceil(chars * tokens_per_char / SLOTS_PER_FRAME))
    return min(whole, frames * SLOTS_PER_FRAME)


# --- generated ids -> SNAC frames ---------------------------------------------------------------------

Frame = tuple[int, int, int, int, int, int, int]


@dataclass
class ParseStats:
    frames: int = 0
    ignored_ids: int = 0  # non-audio ids (e.g. a repeated start-of-speech)
    dropped_tokens: int = 0  # audio ids thrown away while resynchronising on slot 0


class AudioTokenParser:
    """Turns generated ids into complete 7-code frames, by id rather than by position.

    The slot of a token is read from its id, so a token in the wrong slot (a skipped or repeated one)
    only costs the frame it breaks: the parser drops the partial frame and restarts at the next slot-0
    token, instead of shifting every later frame as position counting does.
    """

    def __init__(self) -> None:
        self._partial: list[int] = []
        self.stats = ParseStats()
        self.finished = False

    def feed(self, token_ids: Iterable[int]) -> list[Frame]:
        frames: list[Frame] = []
        for token_id in token_ids:
            if self.finished:
                break
            if token_id == END_OF_SPEECH_ID:
                self.finished = True
                break
            if not AUDIO_TOKEN_BASE <= token_id < AUDIO_TOKEN_END:
                self.stats.ignored_ids += 1
                continue
            slot, code = divmod(token_id - AUDIO_TOKEN_BASE, CODEBOOK_SIZE)
            if slot != len(self._partial):
                self.stats.dropped_tokens += len(self._partial)
                self._partial.clear()
                if slot != 0:
                    self.stats.dropped_tokens += 1
                    continue
            self._partial.append(code)
            if len(self._partial) == SLOTS_PER_FRAME:
                frames.append(tuple(self._partial))  # type: ignore[arg-type]
                self._partial.clear()
        self.stats.frames += len(frames)
        return frames

    def finish(self) -> None:
        """End of generation: an incomplete trailing frame cannot be decoded and counts as dropped."""
        self.stats.dropped_tokens += len(self._partial)
        self._partial.clear()
        self.finished = True


def frames_to_layers(frames: Sequence[Frame]) -> tuple[list[int], list[int], list[int]]:
    """SNAC layer codes for consecutive frames: L0 (T), L1 (2T), L2 (4T)."""
    l0: list[int] = []
    l1: list[int] = []
    l2: list[int] = []
    for c in frames:
        l0.append(c[0])
        l1 += (c[1], c[4])
        l2 += (c[2], c[3], c[5], c[6])
    return l0, l1, l2


def audio_token_id(k: int, code: int) -> int:
    """Id of the k-th audio token of an utterance with the given code (tests, synthetic streams)."""
    return AUDIO_TOKEN_BASE + CODEBOOK_SIZE * (k % SLOTS_PER_FRAME) + code
