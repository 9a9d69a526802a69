"""Word timings and visemes for one sentence: the sentence's text + its PCM (24 kHz mono int16, as the
speech side produces it) -> word spans (`WordTiming`: text, character offsets into the text as given,
start_ms, duration_ms) and viseme spans (`VisemeTiming`, Oculus-15 set) for avatar lip-sync.

Owns:
- `words`: splitting a sentence into words with character offsets, and a cheap model-free estimate of word
  timings from the audio's energy (pauses) and syllable counts (`estimate_word_timings`).
- `aligner`: CTC forced alignment against a wav2vec2-style `...ForCTC` checkpoint (`CtcAligner`), with its own
  Viterbi trellis (`ctc_forced_align`), for accurate word timings when a model is configured.
- `visemes`: phonemes per word from a G2P (espeak-ng through phonemizer; letter rules as the fallback), one
  IPA -> viseme table, visemes timed inside their word's span (`visemes_for_words`).
- `devmodel`: a tiny random CTC checkpoint for tests.
- `errors`: its exceptions (`AlignmentError`).

May import: numpy; torch, transformers and av (resampling) in `aligner` / `devmodel` only, imported
lazily; phonemizer + espeakng-loader (the G2P) in `visemes` only, lazily; nothing from other gateway packages
except `gateway.orpheus` (for SAMPLE_RATE = 24000). Nothing else in the gateway is imported from here, so the
speech, media and edge sides can call it without cycles; importing this package costs only numpy.
"""

from __future__ import annotations

from gateway.timing.aligner import CtcAligner, ctc_forced_align
from gateway.timing.visemes import OCULUS_VISEMES, VisemeTiming, g2p_name, visemes_for_words
from gateway.timing.words import WordTiming, estimate_word_timings, split_words

__all__ = [
    "OCULUS_VISEMES",
    "CtcAligner",
    "VisemeTiming",
    "WordTiming",
    "ctc_forced_align",
    "estimate_word_timings",
    "g2p_name",
    "split_words",
    "visemes_for_words",
]
