"""Words of a sentence with their character offsets, and word timings estimated from the sentence's PCM.

`split_words(text)` finds the words as the text was given (offsets index the caller's string): runs of letters,
digits and combining marks joined by inner apostrophes and hyphens; punctuation and emotive tags are not words.
`estimate_word_timings(text, pcm)` spreads the words over the sentence's real audio without a model: voice
activity from 10 ms frames, words weighed by phonemes and syllables, pauses matched to word boundaries by a small
dynamic programme. Every word gets a span; spans are ordered, do not overlap and lie inside the audio. The method,
its accuracy against espeak-ng's word events and its cost: docs/decisions/word-timings.md; for lip-sync-grade
timing use `aligner`.
"""

from __future__ import annotations

import itertools
import math
import re
import unicodedata
from dataclasses import dataclass

import numpy as np

from gateway.orpheus import SAMPLE_RATE

# A word character: a Unicode letter or digit (`[^\W_]`), or a combining mark (text given in NFD form).
_WORD_CHAR = r"(?:[^\W_]|[\u0300-\u036f])"
# Inner joiners: ASCII and typographic apostrophes, hyphen-minus, hyphen, non-breaking hyphen.
_JOINER = r"['’ʼ\-‐‑]"
_TOKEN = re.compile(rf"(?P<tag><[^<>\s][^<>]*>)|(?P<word>{_WORD_CHAR}+(?:{_JOINER}{_WORD_CHAR}+)*)")
_STRONG_PUNCT = re.compile(r"[.!?…;:。！？]")
_WEAK_PUNCT = re.compile(r"[,，、—–()\[\]\"“”«»]|\s-\s")
_VOWELS = re.compile(r"[aeiouyæœøåəɛɔ]+")

FRAME_S = 0.010  # voice-activity frame
_REL_THRESHOLD_DB = 30.0  # under the loud (95th percentile) frames
_FLOOR_MARGIN_DB = 10.0  # over the quietest (5th percentile) frames
_MIN_GAP_S = 0.040  # shorter silences are closed (inside a syllable)
_NEUTRAL_PAUSE_FRAMES = 8.0  # pauses up to 80 ms (stop closures) say nothing about word boundaries
_SKIP_SCALE = 0.5
_SIGMA_SCALE = 0.5
_MIN_VOICED_S = 0.030  # shorter voiced blips are dropped (clicks)
_TAG_WEIGHT = 8.0  # an emotive tag (<laugh>) lasts about as long as a 6-phoneme word


@dataclass(frozen=True)
class WordTiming:
    """One word of a sentence and where it is heard in the sentence's audio (milliseconds from its start).

    `text == sentence[char_start:char_end]`. `source` tells how the timing was found: "estimated" (from the
    audio's energy and syllable counts) or "aligned" (CTC forced alignment)."""

    text: str
    char_start: int
    char_end: int
    start_ms: int
    duration_ms: int
    source: str = "estimated"

    @property
    def end_ms(self) -> int:
        return self.start_ms + self.duration_ms


@dataclass(frozen=True)
class Token:
    """A word or an emotive tag found in a sentence, with its character offsets."""

    text: str
    char_start: int
    char_end: int
    is_tag: bool = False


def tokenize(text: str) -> list[Token]:
    """Words and emotive tags (`<laugh>`) of `text` in order, with offsets into `text` as given."""
    tokens: list[Token] = []
    for match in _TOKEN.finditer(text):
        is_tag = match.group("tag") is not None
        tokens.append(Token(match.group(0), match.start(), match.end(), is_tag))
    return tokens


def split_words(text: str) -> list[Token]:
    """The words of `text` (tags and punctuation excluded) with offsets: `text[w.char_start:w.char_end] == w.text`."""
    return [t for t in tokenize(text) if not t.is_tag]


def strip_accents(text: str) -> str:
    """`text` without combining marks (ã -> a, ç -> c), lower case."""
    decomposed = unicodedata.normalize("NFD", text.lower())
    return "".join(c for c in decomposed if not unicodedata.combining(c))


def syllable_count(word: str, language: str | None = None) -> float:
    """A rough syllable count: vowel groups (accents stripped); digits 1.5 each; at least 1.

    With an English `language` a final silent `e` is not counted (`make`, but `table`, `be`)."""
    plain = strip_accents(word)
    digits = sum(c.isdigit() for c in plain)
    letters = "".join(c for c in plain if c.isalpha())
    groups = len(_VOWELS.findall(letters))
    if (language or "").lower().startswith("en") and groups > 1 and letters.endswith("e") \
            and not letters.endswith(("le", "ee", "ye")):
        groups -= 1
    if groups == 0 and letters:
        groups = max(1, math.ceil(len(letters) * 0.5))  # "TV", "brr": spelled or short
    return max(1.0, groups + 1.5 * digits)


# Letter pairs that are mostly one phoneme (English and Portuguese spellings).
_DIGRAPHS = re.compile(r"th|sh|ch|ph|ck|ng|wh|gh|qu|gu|lh|nh|rr|ss|ll|ee|oo|ea|ou|ai|ay|ey|oa|ão|õe")


def phoneme_count(word: str, language: str | None = None) -> float:
    """A rough phoneme count from the spelling: letters, common digraphs counted once, a silent English final
    `e` dropped, digits 3 each; at least 1."""
    lowered = unicodedata.normalize("NFC", word.lower())
    letters = "".join(c for c in lowered if c.isalpha())
    digits = sum(c.isdigit() for c in lowered)
    count = len(letters) - len(_DIGRAPHS.findall(letters))
    if (language or "").lower().startswith("en") and len(letters) > 2 and letters.endswith("e") \
            and not letters.endswith(("ee", "le")):
        count -= 1
    return max(1.0, count + 3.0 * digits)


def word_weight(word: str, language: str | None = None) -> float:
    """Relative duration of a word: its phoneme count plus half its syllable count plus a constant (short
    function words are quick, but not free). Fitted on espeak-ng's word timings (en-us, pt-br), where the
    phoneme count explained durations better than syllables (mean error 64 vs 108 ms per word)."""
    return phoneme_count(word, language) + 0.5 * syllable_count(word, language) + 0.3


def _pause_hint(between: str) -> float:
    """How strongly the text between two tokens suggests a pause: 2 for a period, 1 for a comma, else 0."""
    if _STRONG_PUNCT.search(between):
        return 2.0
    if _WEAK_PUNCT.search(between):
        return 1.0
    return 0.0


def frame_levels_db(pcm: np.ndarray, sample_rate: int, frame_s: float = FRAME_S) -> np.ndarray:
    """RMS level of each `frame_s` frame in dB relative to full scale (int16); -120 dB for digital silence."""
    samples = np.asarray(pcm)
    frame = max(1, round(sample_rate * frame_s))
    n_frames = len(samples) // frame
    if n_frames == 0:
        return np.zeros(0, dtype=np.float64)
    x = samples[: n_frames * frame].astype(np.float32).reshape(n_frames, frame)
    if samples.dtype == np.int16:
        x /= 32768.0
    power = np.einsum("ij,ij->i", x, x, dtype=np.float64) / frame
    return 10.0 * np.log10(np.maximum(power, 1e-12))


def voiced_regions(pcm: np.ndarray, sample_rate: int, frame_s: float = FRAME_S) -> list[tuple[int, int]]:
    """Voiced regions of the audio as `(first_frame, end_frame)` in `frame_s` frames, ordered, disjoint."""
    levels = frame_levels_db(pcm, sample_rate, frame_s)
    if len(levels) == 0:
        return []
    loud = float(np.percentile(levels, 95))
    quiet = float(np.percentile(levels, 5))
    threshold = max(loud - _REL_THRESHOLD_DB, quiet + _FLOOR_MARGIN_DB)
    voiced = levels > threshold
    if not voiced.any():
        return []
    edges = np.flatnonzero(np.diff(np.concatenate(([0], voiced.astype(np.int8), [0]))))
    regions = [(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)]
    min_gap = max(1, round(_MIN_GAP_S / frame_s))
    merged: list[tuple[int, int]] = [regions[0]]
    for start, end in regions[1:]:
        if start - merged[-1][1] < min_gap:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    min_voiced = max(1, round(_MIN_VOICED_S / frame_s))
    kept = [r for r in merged if r[1] - r[0] >= min_voiced]
    return kept or [max(merged, key=lambda r: r[1] - r[0])]


def _match_pauses(pause_pos: np.ndarray, pause_len: np.ndarray, bound_pos: np.ndarray, bound_hint: np.ndarray,
                  sigma: np.ndarray) -> list[tuple[int, int]]:
    """Monotone matching of pauses to word boundaries minimising the total cost; returns (boundary, pause) pairs.

    Positions are on the voiced timeline (frames). A matched pair costs its squared distance in units of the
    boundary's `sigma` minus a bonus that grows with the pause's length, doubled by a comma after the word
    (tripled by a period); an unmatched pause (a silence inside a word) costs a little, more when long; an
    unmatched boundary is free."""
    n_p, n_b = len(pause_pos), len(bound_pos)
    if n_p == 0 or n_b == 0:
        return []
    dist = (pause_pos[:, None] - bound_pos[None, :]) / sigma[None, :]
    effective = np.maximum(pause_len - _NEUTRAL_PAUSE_FRAMES, 0.0)
    match_cost = 0.5 * dist**2 - np.log1p(effective / 10.0)[:, None] * (1.0 + bound_hint[None, :])
    skip_pause = _SKIP_SCALE * np.log1p(effective / 5.0)
    inf = float("inf")
    cost = np.full((n_p + 1, n_b + 1), inf)
    move = np.zeros((n_p + 1, n_b + 1), dtype=np.int8)  # 1 skip pause, 2 skip boundary, 3 match
    cost[0, :] = 0.0
    move[0, 1:] = 2
    for i in range(1, n_p + 1):
        cost[i, 0] = cost[i - 1, 0] + skip_pause[i - 1]
        move[i, 0] = 1
        for j in range(1, n_b + 1):
            best, how = cost[i - 1, j] + skip_pause[i - 1], 1
            if cost[i, j - 1] < best:
                best, how = cost[i, j - 1], 2
            matched = cost[i - 1, j - 1] + match_cost[i - 1, j - 1]
            if matched < best:
                best, how = matched, 3
            cost[i, j], move[i, j] = best, how
    pairs: list[tuple[int, int]] = []
    i, j = n_p, n_b
    while i > 0 or j > 0:
        how = move[i, j]
        if how == 3:
            pairs.append((j - 1, i - 1))
            i, j = i - 1, j - 1
        elif how == 1:
            i -= 1
        else:
            j -= 1
    return pairs[::-1]


def _voiced_to_real(pos: float, regions: list[tuple[int, int]], cum: np.ndarray, *, as_start: bool) -> float:
    """Map a position on the voiced timeline to real frames. At a region edge a start goes to the next region's
    start, an end to the previous region's end (so words never begin or end in a pause)."""
    ends = cum[1:]
    idx = int(np.searchsorted(ends, pos, side="right" if as_start else "left"))
    idx = min(idx, len(regions) - 1)
    start, _ = regions[idx]
    return start + (pos - cum[idx])


def layout_spans(weights: list[float], hints: list[float], regions: list[tuple[int, int]]) -> list[tuple[float, float]]:
    """Spread items of `weights` over voiced `regions` (frames); `hints[k]` is the pause hint after item k.

    Returns one (start, end) in frames per item, ordered and non-overlapping."""
    n = len(weights)
    if n == 0:
        return []
    lengths = np.array([e - s for s, e in regions], dtype=np.float64)
    cum = np.concatenate(([0.0], np.cumsum(lengths)))
    total = float(cum[-1])
    w = np.asarray(weights, dtype=np.float64)
    bounds = total * np.cumsum(w)[:-1] / w.sum()
    pause_pos = cum[1:-1]
    pause_len = np.array([regions[i + 1][0] - regions[i][1] for i in range(len(regions) - 1)], dtype=np.float64)
    # Uncertainty of a proportional boundary: syllable timing errors add up from the nearer end of the sentence.
    k = np.arange(1, n)
    sigma = np.maximum(_SIGMA_SCALE * total / n * np.sqrt(1.0 + np.minimum(k, n - k)), 8.0)
    pairs = _match_pauses(pause_pos, pause_len, bounds, np.asarray(hints[:-1], dtype=np.float64), sigma)

    # Boundaries on the voiced timeline: matched ones sit on their pause; the others are spread by weight
    # between the matched ones around them.
    anchored = [(-1, 0.0), *[(k, float(pause_pos[p])) for k, p in pairs], (n - 1, total)]
    voiced_bounds = np.zeros(n + 1)
    for (k0, pos0), (k1, pos1) in itertools.pairwise(anchored):
        seg_w = w[k0 + 1 : k1 + 1]
        voiced_bounds[k0 + 1 : k1 + 2] = pos0 + (pos1 - pos0) * np.concatenate(([0.0], np.cumsum(seg_w))) / seg_w.sum()
    spans: list[tuple[float, float]] = []
    for k in range(n):
        start = _voiced_to_real(float(voiced_bounds[k]), regions, cum, as_start=True)
        end = _voiced_to_real(float(voiced_bounds[k + 1]), regions, cum, as_start=False)
        spans.append((start, max(start, end)))
    return spans


def fit_spans_ms(spans_ms: list[tuple[float, float]], total_ms: int) -> list[tuple[int, int]]:
    """Millisecond spans -> integer (start_ms, end_ms): ordered, non-overlapping, inside [0, total_ms], each at
    least 1 ms long wherever the audio has room for that."""
    starts = [min(total_ms, max(0, round(s))) for s, _ in spans_ms]
    ends = [min(total_ms, max(0, round(e))) for _, e in spans_ms]
    prev_end = 0
    for i in range(len(spans_ms)):  # forward: ordered, at least 1 ms
        starts[i] = max(starts[i], prev_end)
        ends[i] = max(ends[i], starts[i] + 1)
        prev_end = ends[i]
    limit = total_ms
    for i in reversed(range(len(spans_ms))):  # backward: inside the audio
        ends[i] = min(ends[i], limit)
        starts[i] = max(0, min(starts[i], ends[i] - 1))
        limit = starts[i]
    return list(zip(starts, ends, strict=True))


def estimate_word_timings(text: str, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE,
                          language: str | None = None) -> list[WordTiming]:
    """Word timings of one sentence from its audio's energy and its words' syllable counts (no model).

    `pcm`: the sentence's mono samples (int16, or float in [-1, 1]). Returns one `WordTiming` per word of
    `split_words(text)` with `source="estimated"`."""
    tokens = tokenize(text)
    if not tokens:
        return []
    samples = np.asarray(pcm).reshape(-1)
    total_ms = int(len(samples) * 1000 // sample_rate)
    frame = max(1, round(sample_rate * FRAME_S))
    frame_ms = frame * 1000.0 / sample_rate
    regions = voiced_regions(samples, sample_rate)
    if not regions:
        n_frames = len(samples) / frame
        regions = [(0, max(1, math.ceil(n_frames)))] if len(samples) else [(0, 0)]
    weights = [_TAG_WEIGHT if t.is_tag else word_weight(t.text, language) for t in tokens]
    hints = []
    for i, tok in enumerate(tokens):
        nxt = tokens[i + 1].char_start if i + 1 < len(tokens) else len(text)
        hint = _pause_hint(text[tok.char_end : nxt])
        if tok.is_tag or (i + 1 < len(tokens) and tokens[i + 1].is_tag):
            hint = max(hint, 1.0)
        hints.append(hint)
    spans = layout_spans(weights, hints, regions) if regions[0][1] > regions[0][0] else [(0.0, 0.0)] * len(tokens)
    ms_spans = fit_spans_ms([(a * frame_ms, b * frame_ms) for a, b in spans], total_ms)
    return [
        WordTiming(t.text, t.char_start, t.char_end, start, end - start, "estimated")
        for t, (start, end) in zip(tokens, ms_spans, strict=True)
        if not t.is_tag
    ]
