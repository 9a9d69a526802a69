"""CTC forced alignment of a sentence's PCM against its text with a wav2vec2-style `...ForCTC` checkpoint.

The text is known (we made the audio from it), so nothing is recognised: the model's per-frame token
log-probabilities are aligned to the text's tokens by the standard CTC Viterbi (`ctc_forced_align`, in numpy:
torchaudio's `forced_align` does the same, but torchaudio breaks the CPU torch), and a word spans its tokens'
frames. Character and phoneme (espeak IPA) vocabularies are both handled; the audio is resampled to the model's
rate with `av.AudioResampler`. Where the audio has fewer frames than the text needs tokens, `align` falls back to
`words.estimate_word_timings`. Checkpoints, licences and cost: docs/decisions/word-timings.md.
"""

from __future__ import annotations

import itertools
import logging
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gateway.orpheus import SAMPLE_RATE
from gateway.timing.errors import AlignmentError
from gateway.timing.words import (
    Token,
    WordTiming,
    estimate_word_timings,
    fit_spans_ms,
    split_words,
    strip_accents,
    word_weight,
)

log = logging.getLogger(__name__)

MAX_TAIL_FRAMES = 3  # blank frames after a word's last token still counted as the word (60 ms at 20 ms)
_APOSTROPHES = {"’": "'", "ʼ": "'", "‘": "'", "`": "'"}


@dataclass(frozen=True)
class TokenSpan:
    """Frames `[start, end)` of the best path spent on target token `index` (id `token_id`); `score` is the
    mean log-probability of the token over those frames."""

    index: int
    token_id: int
    start: int
    end: int
    score: float


def ctc_forced_align(log_probs: np.ndarray, targets: Sequence[int], blank: int = 0) -> list[TokenSpan]:
    """CTC Viterbi forced alignment: the most probable frame path that reads `targets` (blanks allowed
    anywhere, a blank required between two equal consecutive tokens).

    `log_probs`: (frames, vocab) log-probabilities (log-softmax of the logits). Returns one `TokenSpan` per
    target, in order; each token gets at least one frame. Raises `AlignmentError` when no path exists."""
    lp = np.asarray(log_probs, dtype=np.float64)
    n_frames = lp.shape[0]
    tgt = np.asarray(targets, dtype=np.int64)
    if len(tgt) == 0:
        return []
    if np.any(tgt == blank):
        raise ValueError("targets must not contain the blank")
    ext = np.full(2 * len(tgt) + 1, blank, dtype=np.int64)
    ext[1::2] = tgt
    n_states = len(ext)
    # a skip from s-2 to s is allowed onto a token that differs from the token two states back
    skip_ok = np.zeros(n_states, dtype=bool)
    skip_ok[3::2] = tgt[1:] != tgt[:-1]
    neg_inf = -np.inf
    if n_frames == 0:
        raise AlignmentError("no frames")
    alpha = np.full(n_states, neg_inf)
    alpha[0] = lp[0, ext[0]]
    alpha[1] = lp[0, ext[1]]
    back = np.zeros((n_frames, n_states), dtype=np.int8)
    emit = lp[:, ext]  # (frames, states)
    shifted1 = np.empty(n_states)
    shifted2 = np.empty(n_states)
    for t in range(1, n_frames):
        shifted1[0] = neg_inf
        shifted1[1:] = alpha[:-1]
        shifted2[:2] = neg_inf
        shifted2[2:] = alpha[:-2]
        shifted2[~skip_ok] = neg_inf
        stacked = np.stack((alpha, shifted1, shifted2))
        choice = np.argmax(stacked, axis=0)
        back[t] = choice
        alpha = stacked[choice, np.arange(n_states)] + emit[t]
    last = n_states - 1 if alpha[-1] >= alpha[-2] else n_states - 2
    if not np.isfinite(alpha[last]):
        raise AlignmentError(f"{n_frames} frames cannot hold {len(tgt)} tokens")
    states = np.empty(n_frames, dtype=np.int64)
    s = last
    for t in range(n_frames - 1, -1, -1):
        states[t] = s
        s -= int(back[t, s])
    spans: list[TokenSpan] = []
    token_frames = states % 2 == 1
    idx = np.flatnonzero(token_frames)
    token_of = states[idx] // 2
    bounds = np.flatnonzero(np.diff(token_of)) + 1
    for group in np.split(np.arange(len(idx)), bounds):
        frames = idx[group]
        i = int(token_of[group[0]])
        score = float(np.mean(lp[frames, tgt[i]]))
        spans.append(TokenSpan(i, int(tgt[i]), int(frames[0]), int(frames[-1]) + 1, score))
    return spans


def resample(pcm: np.ndarray, src_rate: int, dst_rate: int) -> np.ndarray:
    """Mono PCM (int16 or float in [-1, 1]) at `src_rate` -> float32 at `dst_rate`, with libswresample."""
    import av

    samples = np.asarray(pcm).reshape(-1)
    if samples.dtype != np.int16:
        samples = np.clip(np.round(samples.astype(np.float64) * 32767.0), -32768, 32767).astype(np.int16)
    if src_rate == dst_rate or len(samples) == 0:
        return samples.astype(np.float32) / 32768.0
    resampler = av.AudioResampler(format="flt", layout="mono", rate=dst_rate)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples).reshape(1, -1), format="s16", layout="mono")
    frame.sample_rate = src_rate
    out = resampler.resample(frame) + resampler.resample(None)
    return np.concatenate([f.to_ndarray().reshape(-1) for f in out]).astype(np.float32, copy=False)


class CtcAligner:
    """Forced aligner around one `...ForCTC` checkpoint and its tokenizer + feature extractor."""

    def __init__(self, model: Any, tokenizer: Any, feature_extractor: Any, device: str = "cpu",
                 units: str = "auto") -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.feature_extractor = feature_extractor
        self.device = device
        self.sampling_rate = int(getattr(feature_extractor, "sampling_rate", 16000))
        self.frame_s = int(getattr(model.config, "inputs_to_logits_ratio", 320)) / self.sampling_rate
        n_logits = int(model.config.vocab_size)
        self.vocab = {tok: i for tok, i in tokenizer.get_vocab().items() if i < n_logits}
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else model.config.pad_token_id
        self.blank = int(pad_id if pad_id is not None else 0)
        specials = {tokenizer.unk_token, tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token}
        self.unk_id = self.vocab.get(tokenizer.unk_token) if tokenizer.unk_token else None
        if self.unk_id == self.blank:
            self.unk_id = None
        delimiter = getattr(tokenizer, "word_delimiter_token", None)
        self.delimiter_id = self.vocab.get(delimiter) if delimiter else None
        if units == "auto":
            units = "phonemes" if "Phoneme" in type(tokenizer).__name__ else "chars"
        if units not in ("chars", "phonemes"):
            raise ValueError(f"units must be 'auto', 'chars' or 'phonemes', not {units!r}")
        self.units = units
        letters = [t for t in self.vocab if len(t) == 1 and t.isalpha() and t not in specials]
        has_lower = any(t.islower() for t in letters)
        has_upper = any(t.isupper() for t in letters)
        self.case = "upper" if has_upper and not has_lower else "lower" if has_lower and not has_upper else "keep"

    @classmethod
    def load(cls, name_or_path: str | Path, device: str = "cpu", units: str = "auto",
             **from_pretrained: Any) -> CtcAligner:
        """Load a checkpoint (hub name or local folder) with `AutoModelForCTC` and its processor
        (`AutoProcessor`, else `AutoTokenizer` + `AutoFeatureExtractor`). `units`: "chars", "phonemes" or
        "auto" (phonemes for a `Wav2Vec2PhonemeCTCTokenizer`). Extra keywords go to every `from_pretrained`
        (e.g. `local_files_only=True`, `revision=`)."""
        from transformers import AutoFeatureExtractor, AutoModelForCTC, AutoProcessor, AutoTokenizer

        model = AutoModelForCTC.from_pretrained(str(name_or_path), **from_pretrained).to(device)
        tokenizer = feature_extractor = None
        try:
            processor = AutoProcessor.from_pretrained(str(name_or_path), **from_pretrained)
            tokenizer = getattr(processor, "tokenizer", None)
            feature_extractor = getattr(processor, "feature_extractor", None)
        except (OSError, ValueError, TypeError) as exc:
            log.debug("AutoProcessor failed for %s: %s", name_or_path, exc)
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(str(name_or_path), **from_pretrained)
        if feature_extractor is None:
            feature_extractor = AutoFeatureExtractor.from_pretrained(str(name_or_path), **from_pretrained)
        return cls(model, tokenizer, feature_extractor, device=device, units=units)

    # --- text -> token ids -------------------------------------------------------------------------------

    def _char_id(self, char: str) -> int | None:
        if char in _APOSTROPHES:
            char = _APOSTROPHES[char]
        if self.case == "upper":
            char = char.upper()
        elif self.case == "lower":
            char = char.lower()
        tok = self.vocab.get(char)
        if tok is None and char.isalpha():
            plain = strip_accents(char)
            plain = plain.upper() if self.case == "upper" else plain
            tok = self.vocab.get(plain) if len(plain) == 1 else None
        if tok is None or tok == self.blank or tok == self.unk_id or tok == self.delimiter_id:
            return None
        return tok

    def _phone_ids(self, phone: str) -> list[int]:
        tok = self.vocab.get(phone)
        if tok is None:
            stripped = "".join(c for c in phone if c not in "ˈˌːˑ")
            tok = self.vocab.get(stripped)
            if tok is None:
                return [t for c in stripped if (t := self.vocab.get(c)) is not None and t != self.blank]
        return [tok] if tok != self.blank else []

    def word_token_ids(self, word: str, language: str | None = None) -> list[int]:
        """The vocabulary ids this word is read as (unknown characters skipped; may be empty)."""
        if self.units == "phonemes":
            from gateway.timing.visemes import phonemize_word

            return [t for phone in phonemize_word(word, language or "en-us") for t in self._phone_ids(phone)]
        text = unicodedata.normalize("NFC", word)
        return [t for c in text if (t := self._char_id(c)) is not None]

    # --- audio -> log-probabilities ----------------------------------------------------------------------

    def log_probs(self, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE) -> np.ndarray:
        """(frames, vocab) CTC log-probabilities of the audio."""
        import torch

        audio = resample(pcm, sample_rate, self.sampling_rate)
        features = self.feature_extractor(audio, sampling_rate=self.sampling_rate, return_tensors="pt")
        inputs = features["input_values"].to(self.device)
        with torch.inference_mode():
            logits = self.model(inputs).logits[0]
            return torch.log_softmax(logits.float(), dim=-1).cpu().numpy()

    # --- alignment ----------------------------------------------------------------------------------------

    def align(self, text: str, pcm: np.ndarray, sample_rate: int = SAMPLE_RATE,
              language: str | None = None) -> list[WordTiming]:
        """One `WordTiming` per word of `words.split_words(text)` with `source="aligned"`: ordered,
        non-overlapping, inside the audio (falls back to estimated timings when no CTC path exists)."""
        words = split_words(text)
        if not words:
            return []
        samples = np.asarray(pcm).reshape(-1)
        total_ms = int(len(samples) * 1000 // sample_rate)
        targets: list[int] = []
        owner: list[int] = []  # word index of each target, -1 for a delimiter
        for i, word in enumerate(words):
            ids = self.word_token_ids(word.text, language)
            if not ids and self.unk_id is not None:
                ids = [self.unk_id]
            if ids and targets and self.delimiter_id is not None:
                targets.append(self.delimiter_id)
                owner.append(-1)
            targets.extend(ids)
            owner.extend([i] * len(ids))
        if not targets or len(samples) == 0:
            return self._fallback(text, samples, sample_rate, language)
        lp = self.log_probs(samples, sample_rate)
        try:
            spans = ctc_forced_align(lp, targets, self.blank)
        except AlignmentError as exc:
            log.info("CTC alignment impossible (%s); estimating word timings instead", exc)
            return self._fallback(text, samples, sample_rate, language)
        return self._word_spans(words, spans, owner, len(lp), total_ms)

    def _fallback(self, text: str, samples: np.ndarray, sample_rate: int, language: str | None) -> list[WordTiming]:
        return estimate_word_timings(text, samples, sample_rate, language)

    def _word_spans(self, words: list[Token], spans: list[TokenSpan], owner: list[int], n_frames: int,
                    total_ms: int) -> list[WordTiming]:
        frame_ms = self.frame_s * 1000.0
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        for k, span in enumerate(spans):
            w = owner[span.index]
            if w < 0:
                continue
            first.setdefault(w, k)
            last[w] = k
        frames: list[tuple[float, float] | None] = []
        for i in range(len(words)):
            if i not in first:
                frames.append(None)
                continue
            start = spans[first[i]].start
            end = spans[last[i]].end
            next_start = spans[last[i] + 1].start if last[i] + 1 < len(spans) else n_frames
            frames.append((float(start), float(min(next_start, end + MAX_TAIL_FRAMES))))
        filled = _fill_missing(frames, [word_weight(w.text) for w in words], float(n_frames))
        ms = fit_spans_ms([(s * frame_ms, e * frame_ms) for s, e in filled], total_ms)
        return [
            WordTiming(w.text, w.char_start, w.char_end, start, end - start, "aligned")
            for w, (start, end) in zip(words, ms, strict=True)
        ]


def _fill_missing(spans: list[tuple[float, float] | None], weights: list[float],
                  total: float) -> list[tuple[float, float]]:
    """Give words without aligned tokens the room between their aligned neighbours (split by weight); when
    there is no room, the previous word gives up its second half."""
    out: list[tuple[float, float] | None] = list(spans)
    i = 0
    while i < len(out):
        if out[i] is not None:
            i += 1
            continue
        j = i
        while j < len(out) and out[j] is None:
            j += 1
        prev = out[i - 1] if i > 0 else None
        nxt = out[j] if j < len(out) else None
        lo = prev[1] if prev is not None else 0.0
        hi = nxt[0] if nxt is not None else total
        if hi - lo < 0.5 * (j - i) and prev is not None:
            mid = (prev[0] + prev[1]) / 2.0
            out[i - 1] = (prev[0], mid)
            lo = mid
        if hi < lo:
            hi = lo
        w = np.asarray(weights[i:j], dtype=np.float64)
        edges = lo + (hi - lo) * np.concatenate(([0.0], np.cumsum(w))) / w.sum()
        for k in range(i, j):
            out[k] = (float(edges[k - i]), float(edges[k - i + 1]))
        i = j
    return [span if span is not None else (0.0, 0.0) for span in out]


def frames_needed(targets: Sequence[int]) -> int:
    """Fewest CTC frames that can hold `targets`: one per token plus one blank between equal neighbours."""
    repeats = sum(1 for a, b in itertools.pairwise(targets) if a == b)
    return len(targets) + repeats


__all__ = [
    "CtcAligner",
    "TokenSpan",
    "ctc_forced_align",
    "frames_needed",
    "resample",
]
