"""Visemes (Oculus-15 set) for timed words: phonemes per word from a G2P, one IPA -> viseme table, visemes
timed inside each word's span.

The G2P is espeak-ng through `phonemizer` (the library from the `espeakng-loader` wheel, else a system
espeak-ng): one rule-based engine for English, Portuguese and ~100 more languages, IPA out, the notation of the
phoneme CTC checkpoint. Without it (or with `GATEWAY_G2P=letters`) a small letter-to-sound rule set
(`LetterG2P`) gives rough IPA; `g2p_name()` says which is in use. Inside a word's span each viseme gets a share by
weight (vowels 2, long vowels 2.5, consonants 1); equal neighbours merge. Why espeak-ng, the alternatives, the
GPL question and the cost: docs/decisions/word-timings.md.
"""

from __future__ import annotations

import logging
import os
import threading
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

from gateway.timing.words import WordTiming

log = logging.getLogger(__name__)

OCULUS_VISEMES: tuple[str, ...] = (
    "sil", "PP", "FF", "TH", "DD", "kk", "CH", "SS", "nn", "RR", "aa", "E", "I", "O", "U",
)
VOWEL_VISEMES = frozenset({"aa", "E", "I", "O", "U"})

# IPA symbol (after stripping stress, length and diacritics) -> Oculus viseme. Multi-letter keys first.
IPA_TO_VISEME: dict[str, str] = {
    # affricates
    "tʃ": "CH", "dʒ": "CH", "ts": "SS", "dz": "SS",
    # bilabials
    "p": "PP", "b": "PP", "m": "PP", "ɱ": "FF",
    # labiodentals
    "f": "FF", "v": "FF", "ʋ": "FF",
    # dentals
    "θ": "TH", "ð": "TH",
    # alveolar stops and taps
    "t": "DD", "d": "DD", "ʈ": "DD", "ɖ": "DD",
    # velars, uvulars, glottals
    "k": "kk", "g": "kk", "ɡ": "kk", "ŋ": "kk", "x": "kk", "ɣ": "kk", "χ": "kk", "q": "kk", "ɢ": "kk",
    "h": "kk", "ɦ": "kk", "ʔ": "kk", "c": "kk", "ɟ": "kk",
    # postalveolars
    "ʃ": "CH", "ʒ": "CH", "ɕ": "CH", "ʑ": "CH", "ç": "CH",
    # sibilants
    "s": "SS", "z": "SS",
    # nasals and laterals
    "n": "nn", "l": "nn", "ɫ": "nn", "ɲ": "nn", "ʎ": "nn", "ɳ": "nn", "ɭ": "nn", "ʟ": "nn",
    # rhotics (Portuguese tap and trill included)
    "ɹ": "RR", "r": "RR", "ɾ": "RR", "ʁ": "RR", "ɻ": "RR", "ʀ": "RR", "ɚ": "RR", "ɝ": "RR",
    # open vowels
    "a": "aa", "ɑ": "aa", "æ": "aa", "ɐ": "aa", "ʌ": "aa", "ɒ": "aa", "ᵻ": "I",
    # mid front / central vowels
    "e": "E", "ɛ": "E", "ə": "E", "ɜ": "E", "ɘ": "E", "œ": "E", "ø": "E",
    # close front vowels and the palatal glide
    "i": "I", "ɪ": "I", "ɨ": "I", "y": "I", "ʏ": "I", "j": "I",
    # rounded back vowels
    "o": "O", "ɔ": "O", "ɵ": "O",
    "u": "U", "ʊ": "U", "ɯ": "U", "ʉ": "U", "w": "U", "ɰ": "U",
}
_IGNORED = set("ˈˌːˑ.‿|-_ ʰʲʷˠˤ̃") | {"\u0303", "\u0361", "\u035c"}
_LONG = "ː"
# Vowel symbols (weighed as vowels; the glides j and w are not, though they show as I and U).
_VOWEL_SYMBOLS = frozenset("aɑæɐʌɒeɛəɜɘœøiɪɨyʏoɔɵuʊɯʉᵻɚɝ")
VOWEL_WEIGHT = 2.0
LONG_VOWEL_WEIGHT = 2.5
CONSONANT_WEIGHT = 1.0

_LANGUAGES = {"en": "en-us", "en-us": "en-us", "en-gb": "en-gb", "pt": "pt", "pt-pt": "pt", "pt-br": "pt-br"}


@dataclass(frozen=True)
class VisemeTiming:
    """One viseme and when it shows (milliseconds from the sentence's start); `word_index` is the index of
    its word in the list given to `visemes_for_words`."""

    viseme: str
    start_ms: int
    duration_ms: int
    word_index: int = -1

    @property
    def end_ms(self) -> int:
        return self.start_ms + self.duration_ms


class G2P(Protocol):
    name: str

    def phonemize(self, word: str, language: str) -> list[str]:
        """IPA phones of one word (may be empty)."""
        ...


def normalize_language(language: str) -> str:
    """'en', 'en-US', 'pt_BR'... -> an espeak-ng voice name ('en-us', 'en-gb', 'pt-br', 'pt')."""
    key = language.strip().lower().replace("_", "-")
    if key in _LANGUAGES:
        return _LANGUAGES[key]
    base = key.split("-", 1)[0]
    if base in _LANGUAGES:
        return _LANGUAGES[base]
    return key


class EspeakG2P:
    """phonemizer's espeak-ng backend, one per language, called one word at a time under a lock."""

    def __init__(self) -> None:
        from phonemizer.backend import EspeakBackend
        from phonemizer.backend.espeak.wrapper import EspeakWrapper
        from phonemizer.separator import Separator

        origin = "system"
        try:
            import espeakng_loader

            EspeakWrapper.set_library(espeakng_loader.get_library_path())
            EspeakWrapper.set_data_path(espeakng_loader.get_data_path())
            origin = "espeakng-loader"
        except ImportError:
            pass
        if not EspeakBackend.is_available():
            raise RuntimeError("espeak-ng library not found")
        self._backend_cls = EspeakBackend
        self._separator = Separator(phone=" ", word=" | ", syllable="")
        self._backends: dict[str, object] = {}
        self._lock = threading.Lock()
        self._quiet = logging.getLogger(__name__ + ".phonemizer")
        self._quiet.setLevel(logging.ERROR)
        version = ".".join(str(v) for v in EspeakBackend.version())
        self.name = f"espeak-ng {version} ({origin}) via phonemizer"

    def _backend(self, language: str) -> object:
        backend = self._backends.get(language)
        if backend is None:
            backend = self._backend_cls(language, preserve_punctuation=False, with_stress=False,
                                        language_switch="remove-flags", logger=self._quiet)
            self._backends[language] = backend
        return backend

    def phonemize(self, word: str, language: str) -> list[str]:
        with self._lock:
            backend = self._backend(language)
            out = backend.phonemize([word], separator=self._separator, strip=True)  # type: ignore[attr-defined]
        return [p for p in out[0].replace("|", " ").split() if p]


class LetterG2P:
    """Letter-to-sound rules for English and Portuguese: rough IPA, used only without espeak-ng."""

    name = "letter rules (fallback, no espeak-ng)"

    _COMMON: tuple[tuple[str, str], ...] = (
        ("ph", "f"), ("qu", "k"), ("ck", "k"), ("ss", "s"), ("ll", "l"), ("rr", "ʁ"),
        ("a", "a"), ("e", "e"), ("i", "i"), ("o", "o"), ("u", "u"), ("y", "i"),
        ("b", "b"), ("d", "d"), ("f", "f"), ("g", "g"), ("k", "k"), ("l", "l"), ("m", "m"), ("n", "n"),
        ("p", "p"), ("r", "ɾ"), ("s", "s"), ("t", "t"), ("v", "v"), ("w", "w"), ("z", "z"),
    )
    _EN: tuple[tuple[str, str], ...] = (
        ("tch", "tʃ"), ("sh", "ʃ"), ("ch", "tʃ"), ("th", "θ"), ("ng", "ŋ"), ("wh", "w"), ("ee", "i"),
        ("oo", "u"), ("ou", "aʊ"), ("ow", "oʊ"), ("ea", "i"), ("ai", "eɪ"), ("ay", "eɪ"), ("oy", "ɔɪ"),
        ("j", "dʒ"), ("x", "ks"), ("c", "k"), ("h", "h"), ("r", "ɹ"), ("q", "k"),
    )
    _PT: tuple[tuple[str, str], ...] = (
        ("ch", "ʃ"), ("lh", "ʎ"), ("nh", "ɲ"), ("gu", "g"), ("ç", "s"), ("ão", "ɐ̃w̃"), ("õe", "õj"),
        ("j", "ʒ"), ("x", "ʃ"), ("c", "k"), ("h", ""), ("q", "k"),
    )

    def phonemize(self, word: str, language: str) -> list[str]:
        text = unicodedata.normalize("NFC", word.lower())
        english = language.startswith("en")
        rules = (self._EN if english else self._PT) + self._COMMON
        phones: list[str] = []
        i = 0
        while i < len(text):
            if english and text[i] == "e" and i == len(text) - 1 and len(phones) > 1:
                break  # silent final e
            if text[i] == "c" and i + 1 < len(text) and text[i + 1] in "eiéêí":
                phones.append("s")
                i += 1
                continue
            for graph, phone in rules:
                if text.startswith(graph, i):
                    if phone:
                        phones.append(phone)
                    i += len(graph)
                    break
            else:
                plain = "".join(c for c in unicodedata.normalize("NFD", text[i]) if not unicodedata.combining(c))
                if plain and plain in "aeiou":
                    phones.append(plain)
                i += 1
        return phones


_g2p: G2P | None = None
_g2p_lock = threading.Lock()


def get_g2p() -> G2P:
    """The G2P in use: espeak-ng through phonemizer when it loads, else `LetterG2P` (also when
    `GATEWAY_G2P=letters`)."""
    global _g2p
    with _g2p_lock:
        if _g2p is None:
            if os.environ.get("GATEWAY_G2P", "").lower() == "letters":
                _g2p = LetterG2P()
            else:
                try:
                    _g2p = EspeakG2P()
                except (ImportError, OSError, RuntimeError) as exc:
                    log.warning("espeak-ng unavailable (%s); visemes come from letter rules", exc)
                    _g2p = LetterG2P()
        return _g2p


def g2p_name() -> str:
    return get_g2p().name


@lru_cache(maxsize=20000)
def _phonemize_cached(word: str, language: str, g2p_name: str) -> tuple[str, ...]:
    return tuple(get_g2p().phonemize(word, language))


def phonemize_word(word: str, language: str) -> tuple[str, ...]:
    """IPA phones of one word (cached per word and language)."""
    g2p = get_g2p()
    return _phonemize_cached(unicodedata.normalize("NFC", word.lower()), normalize_language(language), g2p.name)


def phone_visemes(phone: str) -> list[tuple[str, float]]:
    """Visemes of one IPA phone with their weights. A vowel phone weighs `VOWEL_WEIGHT` (`LONG_VOWEL_WEIGHT`
    when long, x1.5 for a diphthong, shared among its visemes); each consonant viseme `CONSONANT_WEIGHT`."""
    long = _LONG in phone
    decomposed = unicodedata.normalize("NFD", phone)
    base = "".join(c for c in decomposed if c not in _IGNORED and not unicodedata.combining(c))
    visemes: list[str] = []
    vocalic = False
    i = 0
    while i < len(base):
        pair = base[i : i + 2]
        if len(pair) == 2 and pair in IPA_TO_VISEME:
            visemes.append(IPA_TO_VISEME[pair])
            i += 2
            continue
        if base[i] in IPA_TO_VISEME:
            visemes.append(IPA_TO_VISEME[base[i]])
            vocalic = vocalic or base[i] in _VOWEL_SYMBOLS
        i += 1
    if not visemes:
        return []
    if vocalic:
        total = (LONG_VOWEL_WEIGHT if long else VOWEL_WEIGHT) * (1.5 if len(visemes) > 1 else 1.0)
        return [(v, total / len(visemes)) for v in visemes]
    return [(v, CONSONANT_WEIGHT) for v in visemes]


@lru_cache(maxsize=20000)
def _word_visemes_cached(word: str, language: str, g2p_name: str) -> tuple[tuple[str, float], ...]:
    merged: list[tuple[str, float]] = []
    for phone in phonemize_word(word, language):
        for viseme, weight in phone_visemes(phone):
            if merged and merged[-1][0] == viseme:
                merged[-1] = (viseme, merged[-1][1] + weight)
            else:
                merged.append((viseme, weight))
    return tuple(merged)


def word_visemes(word: str, language: str) -> tuple[tuple[str, float], ...]:
    """(viseme, weight) sequence of one word, cached per (word, language)."""
    return _word_visemes_cached(unicodedata.normalize("NFC", word.lower()), normalize_language(language),
                                get_g2p().name)


def visemes_for_words(words: Sequence[WordTiming], language: str) -> list[VisemeTiming]:
    """Visemes of timed words, each word's visemes tiling its span in proportion to their weights.

    `language`: 'en-us', 'en-gb', 'pt-br' or 'pt' (European), or anything espeak-ng knows. Visemes are
    ordered, inside their word's span; a word without any (e.g. only punctuation) gives none. No `sil` is
    emitted: gaps between words are silence."""
    out: list[VisemeTiming] = []
    for index, word in enumerate(words):
        if word.duration_ms <= 0:
            continue
        seq = word_visemes(word.text, language)
        if not seq:
            continue
        total = sum(weight for _, weight in seq)
        acc = 0.0
        prev_edge = word.start_ms
        for viseme, weight in seq:
            acc += weight
            edge = word.start_ms + round(word.duration_ms * acc / total)
            if edge > prev_edge:
                out.append(VisemeTiming(viseme, prev_edge, edge - prev_edge, index))
                prev_edge = edge
    return out


def cache_clear(keep_g2p: bool = False) -> None:
    """Forget cached phonemes and visemes, and (unless `keep_g2p`) the chosen G2P."""
    global _g2p
    _phonemize_cached.cache_clear()
    _word_visemes_cached.cache_clear()
    if not keep_g2p:
        with _g2p_lock:
            _g2p = None
