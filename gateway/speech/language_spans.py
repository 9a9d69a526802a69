"""Mixed-language text: the SSML subset `<lang xml:lang="pt-BR">...</lang>` that marks the spans of one utterance
spoken in another language, each by a model serving it (`gateway.model_table`).

Only `<lang xml:lang="TAG">` and `</lang>` are markup (not nested); every other `<...>` is text as before (Orpheus'
emotive tags such as `<laugh>`). A span is where its text lies in the text as sent, so word offsets index that text,
markup included.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gateway.speech.errors import InvalidRequestError

MARKUP_HINT = '<lang xml:lang="pt-BR">...</lang>'
_OPEN = re.compile(r"""<lang\s+xml:lang\s*=\s*(["'])([A-Za-z]{2,8}(?:-[A-Za-z0-9]{1,8})*)\1\s*>""")
_CLOSE = "</lang>"
_ANY_LANG_TAG = re.compile(r"</?lang\b", re.IGNORECASE)


@dataclass(frozen=True)
class LanguageSpan:
    """`text[start:end]` of the text as sent, in `language` (BCP-47; None: the utterance's own voice)."""

    start: int
    end: int
    language: str | None


def has_markup(text: str) -> bool:
    return _ANY_LANG_TAG.search(text) is not None


def parse_spans(text: str) -> list[LanguageSpan]:
    """The spans of `text` in order (those with nothing to say left out); InvalidRequestError `invalid_markup` for a
    `<lang` that is not the subset (unclosed, nested, stray `</lang>`, no xml:lang)."""
    spans: list[LanguageSpan] = []
    pos = 0
    while (found := _ANY_LANG_TAG.search(text, pos)) is not None:
        _add(spans, text, pos, found.start(), None)
        if text.startswith(_CLOSE, found.start()):
            raise _invalid(f"'</lang>' at {found.start()} closes no <lang>")
        opening = _OPEN.match(text, found.start())
        if opening is None:
            raise _invalid(f"the <lang> at {found.start()} is not of the form {MARKUP_HINT}")
        inner_start = opening.end()
        close = text.find(_CLOSE, inner_start)
        nested = _ANY_LANG_TAG.search(text, inner_start)
        if close < 0:
            raise _invalid(f"the <lang> at {found.start()} is not closed by </lang>")
        if nested is not None and nested.start() < close:
            raise _invalid(f"<lang> at {nested.start()} is nested in the <lang> at {found.start()}")
        _add(spans, text, inner_start, close, opening.group(2))
        pos = close + len(_CLOSE)
    _add(spans, text, pos, len(text), None)
    return spans


def _add(spans: list[LanguageSpan], text: str, start: int, end: int, language: str | None) -> None:
    if any(char.isalnum() for char in text[start:end]):
        spans.append(LanguageSpan(start, end, language))


def _invalid(message: str) -> InvalidRequestError:
    return InvalidRequestError("invalid_markup", f"{message}; mixed-language text marks spans as {MARKUP_HINT}")
