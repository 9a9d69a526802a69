"""What an utterance says, and by which voice: the request rules for its text (`check_text`) and its voice
(`choose_voice`: a voice, `model/voice`, an alias or a language), and a whole text cut into its sentences, each
`<lang>` span by its own language's voice (`voiced_sentences`, `VoicedSentence`).

Pure checks and planning over the configuration's model table: no engine, no decoder. The synthesizer speaks what
this plans; the doors (HTTP, WebRTC, the text stream) check requests with it before anything is generated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.config import GatewayConfig
from gateway.model_table import ModelTableError
from gateway.orpheus import split_sentences
from gateway.speech.errors import InvalidRequestError
from gateway.speech.language_spans import LanguageSpan, has_markup, parse_spans


def resolve_voice(voices: list[str], default: str, voice: str | None,
                  aliases: Mapping[str, str] | None = None) -> str:
    """The voice to speak with: `voice` when it is one of `voices` (or an alias of one), `default` when none is
    named."""
    if voice is None or voice == "":
        return default
    if aliases and voice in aliases:
        return aliases[voice]
    if voice not in voices:
        raise InvalidRequestError("unknown_voice", f"unknown voice {voice!r}; known voices: {voices}"
                                  + (f" and their aliases {sorted(aliases)}" if aliases else ""))
    return voice


def choose_voice(config: GatewayConfig, voice: str | None, language: str | None = None,
                 aliases: Mapping[str, str] | None = None) -> str:
    """The served voice of a request's `voice` (a voice, `model/voice`, or an alias of one) and/or `language`
    (BCP-47: a language alone picks its model's default voice); InvalidRequestError listing what is served."""
    if language is not None and not isinstance(language, str):
        raise InvalidRequestError("invalid_language", "language must be a BCP-47 tag such as en-US or pt-BR")
    if voice and aliases and voice in aliases:
        voice = aliases[voice]
    try:
        return config.model_table.choose(voice or None, language or None, config.voice)
    except ModelTableError as exc:
        raise InvalidRequestError(exc.code, str(exc)
                                  + (f"; aliases: {sorted(aliases)}" if aliases and exc.code == "unknown_voice"
                                     else "")) from None


def check_text(text: Any, max_chars: int, *, so_far: int = 0, allow_empty: bool = False) -> str:
    """The one rule for text to speak: a string, not blank (unless more of it follows: `allow_empty`), and at
    most `max_chars` characters with the `so_far` characters of the same utterance that came before it."""
    if not isinstance(text, str):
        raise InvalidRequestError("invalid_text", "text must be a string")
    if not allow_empty and not text.strip():
        raise InvalidRequestError("empty_text", "text is empty")
    if so_far + len(text) > max_chars:
        raise InvalidRequestError("text_too_long", f"text has {so_far + len(text)} characters; the limit is "
                                  f"{max_chars}")
    return text


@dataclass(frozen=True)
class VoicedSentence:
    """A sentence spoken by a voice of its own (a span of mixed-language text) instead of the utterance's voice."""

    text: str
    voice: str


def span_voices(config: GatewayConfig, spans: Sequence[LanguageSpan], voice: str) -> list[str]:
    """The voice of each span of mixed-language text: the utterance's `voice` where its model serves the span's
    language (or the span names none), else that language's default voice; InvalidRequestError for a language
    no model serves."""
    table = config.model_table
    serving = table.model_for(voice)
    return [voice if span.language is None or serving.serves_language(span.language)
            else choose_voice(config, None, span.language) for span in spans]


def voiced_sentences(config: GatewayConfig, text: str, voice: str) -> list[str | VoicedSentence]:
    """The sentences of a whole text, each span of its `<lang>` markup by its own language's voice."""
    if not has_markup(text):
        return list(split_sentences(text, config.max_sentence_chars))
    spans = parse_spans(text)
    return [sentence if span_voice == voice else VoicedSentence(sentence, span_voice)
            for span, span_voice in zip(spans, span_voices(config, spans, voice), strict=True)
            for sentence in split_sentences(text[span.start:span.end], config.max_sentence_chars)]
