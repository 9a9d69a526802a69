"""gateway.timing: word offsets, estimated word timings on synthetic audio, CTC forced alignment (hand-made
emissions and a tiny random wav2vec2 checkpoint), visemes. Prints (does not assert) CPU ms per second of
audio for the estimator, the aligner on the tiny model and the visemes."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.timing import visemes as visemes_mod
from gateway.timing.aligner import CtcAligner, ctc_forced_align, frames_needed, resample
from gateway.timing.errors import AlignmentError
from gateway.timing.visemes import (
    OCULUS_VISEMES,
    LetterG2P,
    VisemeTiming,
    g2p_name,
    phone_visemes,
    visemes_for_words,
    word_visemes,
)
from gateway.timing.words import (
    WordTiming,
    estimate_word_timings,
    split_words,
    syllable_count,
    tokenize,
    voiced_regions,
)

SR = 24000
PT = "Olá, tudo bem? Eu não sei."
EN = "It's a well-known fact."


# --- helpers ------------------------------------------------------------------------------------------------

def _silence(ms: float) -> np.ndarray:
    return np.zeros(int(SR * ms / 1000), dtype=np.int16)


def _burst(ms: float, rng: np.random.Generator, level: float = 4000.0) -> np.ndarray:
    """Noise with a short fade, standing in for a voiced stretch."""
    n = int(SR * ms / 1000)
    env = np.minimum(1.0, np.minimum(np.arange(n), np.arange(n)[::-1]) / (0.01 * SR))
    return (rng.standard_normal(n) * level * env).astype(np.int16)


def _bursty(bursts_ms: Sequence[float], gaps_ms: Sequence[float], lead_ms: float = 200.0, tail_ms: float = 300.0,
            seed: int = 0) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """PCM of noise bursts separated by silences; returns it with each burst's (start_ms, end_ms)."""
    rng = np.random.default_rng(seed)
    parts = [_silence(lead_ms)]
    spans = []
    t = lead_ms
    for i, ms in enumerate(bursts_ms):
        parts.append(_burst(ms, rng))
        spans.append((t, t + ms))
        t += ms
        if i < len(gaps_ms):
            parts.append(_silence(gaps_ms[i]))
            t += gaps_ms[i]
    parts.append(_silence(tail_ms))
    return np.concatenate(parts), spans


def _check_spans(words: Sequence[WordTiming], text: str, pcm: np.ndarray, sample_rate: int = SR) -> None:
    total_ms = len(pcm) * 1000 // sample_rate
    assert [w.text for w in words] == [w.text for w in split_words(text)]
    prev_end = 0
    for w in words:
        assert text[w.char_start : w.char_end] == w.text
        assert w.duration_ms > 0, w
        assert w.start_ms >= prev_end, (w, prev_end)
        assert w.end_ms <= total_ms, (w, total_ms)
        prev_end = w.end_ms


def _cpu_ms_per_audio_s(fn: object, audio_s: float, repeat: int = 3) -> float:
    assert callable(fn)
    fn()  # warm
    start = time.process_time()
    for _ in range(repeat):
        fn()
    return (time.process_time() - start) * 1000.0 / repeat / audio_s


# --- words --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    (PT, ["Olá", "tudo", "bem", "Eu", "não", "sei"]),
    (EN, ["It's", "a", "well-known", "fact"]),
    ("<laugh> Oh — d’água, guarda-chuva! 3 TVs...", ["Oh", "d’água", "guarda-chuva", "3", "TVs"]),
    ("Cafe\u0301 e\u0300 <sigh> ação.", ["Cafe\u0301", "e\u0300", "ação"]),
    ("", []),
    ("... !? <gasp>", []),
])
def test_split_words_offsets(text: str, expected: list[str]) -> None:
    words = split_words(text)
    assert [w.text for w in words] == expected
    covered = np.zeros(len(text), dtype=bool)
    for w in words:
        assert text[w.char_start : w.char_end] == w.text
        covered[w.char_start : w.char_end] = True
    tags = [t for t in tokenize(text) if t.is_tag]
    for t in tags:
        covered[t.char_start : t.char_end] = True
    # every letter of the text is inside a word or a tag; nothing outside them is a letter
    assert all(covered[i] or not text[i].isalnum() for i in range(len(text)))
    assert all(not any(c in w.text for c in ",.?!;:") for w in words)


def test_syllable_counts() -> None:
    assert syllable_count("tudo") == 2
    assert syllable_count("não") == 1
    assert syllable_count("coração") == 3
    assert syllable_count("make", "en-us") == 1
    assert syllable_count("table", "en-us") == 2
    assert syllable_count("well-known") == 2


@pytest.mark.parametrize(("text", "bursts", "gaps"), [
    (PT, [300, 330, 260, 200, 260, 250], [250, 120, 300, 110, 100]),
    (EN, [220, 120, 450, 300], [100, 90, 110]),
    ("Hello there, my friend.", [260, 240, 180, 300], [120, 300, 150]),
])
def test_estimate_lands_words_in_bursts(text: str, bursts: list[float], gaps: list[float]) -> None:
    pcm, spans = _bursty(bursts, gaps)
    words = estimate_word_timings(text, pcm)
    _check_spans(words, text, pcm)
    assert all(w.source == "estimated" for w in words)
    for w, (b_start, b_end) in zip(words, spans, strict=True):
        # each word sits in its own burst (10 ms frames + fades: 20 ms of slack)
        assert b_start - 20 <= w.start_ms and w.end_ms <= b_end + 20, (w, (b_start, b_end))
        assert w.duration_ms >= 0.6 * (b_end - b_start), (w, (b_start, b_end))
    assert words[0].start_ms >= spans[0][0] - 20  # leading silence excluded
    assert words[-1].end_ms <= spans[-1][1] + 20  # trailing silence excluded


def test_estimate_more_words_than_bursts() -> None:
    text = "It's a well-known fact, my friend."
    pcm, spans = _bursty([900, 700], [400])
    words = estimate_word_timings(text, pcm, language="en-us")
    _check_spans(words, text, pcm)
    by_text = {w.text: w for w in words}
    # the pause sits at the comma: "fact" ends in burst 1, "my" starts in burst 2
    assert by_text["fact"].end_ms <= spans[0][1] + 20
    assert by_text["my"].start_ms >= spans[1][0] - 20


def test_estimate_short_stop_gap_stays_inside_word() -> None:
    # one long word with a 60 ms closure in the middle, then a short word after a long pause
    pcm, spans = _bursty([300, 250, 200], [60, 350])
    words = estimate_word_timings("Understanding it.", pcm, language="en-us")
    _check_spans(words, "Understanding it.", pcm)
    assert words[0].start_ms <= spans[0][0] + 20 and words[0].end_ms >= spans[1][1] - 20
    assert words[1].start_ms >= spans[2][0] - 20


def test_estimate_degenerate_audio() -> None:
    silent = _silence(800)
    words = estimate_word_timings(PT, silent)
    _check_spans(words, PT, silent)
    assert estimate_word_timings("", silent) == []
    empty = estimate_word_timings(EN, np.zeros(0, dtype=np.int16))
    assert [w.text for w in empty] == ["It's", "a", "well-known", "fact"]
    assert all(w.start_ms == 0 and w.duration_ms == 0 for w in empty)
    # float input in [-1, 1] and a tag taking its own time
    pcm, _ = _bursty([300, 400, 300], [200, 200])
    text = "Yes <laugh> indeed."
    words = estimate_word_timings(text, pcm.astype(np.float32) / 32768.0)
    _check_spans(words, text, pcm)
    assert words[1].start_ms >= 200 + 300 + 200 + 400 - 20  # "indeed" after the laugh burst


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(st.sampled_from(["a", "olá", "well-known", "não", "<laugh>", "3", "it's", "coração", "x"]),
                   min_size=1, max_size=14),
    punct=st.lists(st.sampled_from(["", "", ",", ".", " —"]), min_size=14, max_size=14),
    bursts=st.lists(st.integers(20, 700), min_size=1, max_size=8),
    gaps=st.lists(st.integers(10, 600), min_size=8, max_size=8),
    lead=st.integers(0, 400),
)
def test_estimate_invariants(words: list[str], punct: list[str], bursts: list[int], gaps: list[int],
                             lead: int) -> None:
    text = " ".join(w + p for w, p in zip(words, punct, strict=False))
    pcm, _ = _bursty(bursts, gaps[: len(bursts) - 1], lead_ms=lead, tail_ms=lead)
    timings = estimate_word_timings(text, pcm, language="pt-br")
    total_ms = len(pcm) * 1000 // SR
    if total_ms >= len(timings):
        _check_spans(timings, text, pcm)
    assert len(timings) == len(split_words(text))


def test_voiced_regions_relative_threshold() -> None:
    pcm, spans = _bursty([300, 300], [200])
    quiet_noise = (np.random.default_rng(1).standard_normal(len(pcm)) * 20).astype(np.int16)
    regions = voiced_regions(pcm + quiet_noise, SR)
    assert len(regions) == 2
    for (s, e), (b_start, b_end) in zip(regions, spans, strict=True):
        assert abs(s * 10 - b_start) <= 20 and abs(e * 10 - b_end) <= 20


# --- CTC Viterbi ----------------------------------------------------------------------------------------------

def _emissions(path: Sequence[int], vocab: int, p: float = 0.85) -> np.ndarray:
    lp = np.full((len(path), vocab), np.log((1 - p) / (vocab - 1)))
    for t, k in enumerate(path):
        lp[t, k] = np.log(p)
    return lp


def test_viterbi_hand_made_emissions() -> None:
    # blank 0, a 1, b 2, c 3; the frames read "_aa_b__bcc_" -> targets a b b c
    lp = _emissions([0, 1, 1, 0, 2, 0, 0, 2, 3, 3, 0], vocab=4)
    spans = ctc_forced_align(lp, [1, 2, 2, 3], blank=0)
    assert [(s.index, s.token_id, s.start, s.end) for s in spans] == [(0, 1, 1, 3), (1, 2, 4, 5), (2, 2, 7, 8),
                                                                      (3, 3, 8, 10)]
    # the emissions say "ab" but the text says "ba": the path must still read b then a, in order
    spans = ctc_forced_align(_emissions([0, 1, 1, 0, 2, 2, 0], vocab=3), [2, 1], blank=0)
    assert [s.token_id for s in spans] == [2, 1]
    assert spans[0].end <= spans[1].start


def _collapse(labels: Sequence[int], blank: int) -> list[int]:
    return [k for k, _ in itertools.groupby(labels) if k != blank]


@pytest.mark.parametrize("targets", [[1, 2], [1, 1], [2, 1, 2], [1]])
def test_viterbi_matches_brute_force(targets: list[int]) -> None:
    rng = np.random.default_rng(sum(targets) * 7 + len(targets))
    n_frames, vocab = 7, 3
    for _ in range(5):
        logits = rng.standard_normal((n_frames, vocab)) * 2
        lp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        best = max(
            sum(lp[t, k] for t, k in enumerate(labels))
            for labels in itertools.product(range(vocab), repeat=n_frames)
            if _collapse(labels, 0) == targets
        )
        spans = ctc_forced_align(lp, targets, blank=0)
        labels = np.zeros(n_frames, dtype=np.int64)
        for s in spans:
            labels[s.start : s.end] = s.token_id
        assert _collapse(labels.tolist(), 0) == targets
        assert sum(lp[t, k] for t, k in enumerate(labels)) == pytest.approx(best)


def test_viterbi_too_few_frames() -> None:
    assert frames_needed([1, 1, 2]) == 4
    with pytest.raises(AlignmentError):
        ctc_forced_align(_emissions([1, 1, 2], vocab=3), [1, 1, 2], blank=0)
    assert len(ctc_forced_align(_emissions([1, 0, 1, 2], vocab=3), [1, 1, 2], blank=0)) == 3


def test_resample_keeps_time() -> None:
    pcm = np.zeros(SR, dtype=np.int16)
    pcm[12000] = 30000
    out = resample(pcm, SR, 16000)
    assert len(out) == 16000 and out.dtype == np.float32
    assert abs(int(np.argmax(np.abs(out))) - 8000) <= 1


# --- aligner on the tiny random checkpoint --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_ctc_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gateway.timing.devmodel import build_tiny_ctc_model

    return build_tiny_ctc_model(tmp_path_factory.mktemp("tiny-ctc"))


@pytest.fixture(scope="module")
def aligner(tiny_ctc_dir: Path) -> CtcAligner:
    return CtcAligner.load(tiny_ctc_dir, local_files_only=True)


@pytest.mark.parametrize("text", [PT, EN, "Hello <laugh> there, 3 friends — café!"])
def test_aligner_plumbing(aligner: CtcAligner, text: str) -> None:
    pcm, _ = _bursty([400, 500, 300], [150, 200], seed=3)
    words = aligner.align(text, pcm, SR)
    _check_spans(words, text, pcm)
    assert all(w.source == "aligned" for w in words)


def test_aligner_token_mapping(aligner: CtcAligner, tmp_path: Path) -> None:
    vocab = aligner.vocab
    assert aligner.case == "lower" and aligner.units == "chars"
    assert aligner.word_token_ids("Não") == [vocab["n"], vocab["ã"], vocab["o"]]
    assert aligner.word_token_ids("It’s") == [vocab["i"], vocab["t"], vocab["'"], vocab["s"]]
    assert aligner.word_token_ids("well-known") == [vocab[c] for c in "wellknown"]
    assert aligner.word_token_ids("3") == []  # no digits in this vocabulary
    # an upper-case vocabulary without accents or <unk> (like wav2vec2-base-960h's letters)
    from gateway.timing.devmodel import build_tiny_ctc_model

    upper_vocab = ["<pad>", "|", *"ABCDEFGHIJKLMNOPQRSTUVWXYZ'"]
    upper = CtcAligner.load(build_tiny_ctc_model(tmp_path / "upper", vocab=upper_vocab))
    assert upper.case == "upper" and upper.unk_id is None
    assert upper.word_token_ids("Café") == [upper.vocab[c] for c in "CAFE"]
    pcm, _ = _bursty([400, 400], [200], seed=4)
    text = "Café 42 ação."
    words = upper.align(text, pcm, SR)
    _check_spans(words, text, pcm)


def test_aligner_maps_frames_to_words(aligner: CtcAligner, monkeypatch: pytest.MonkeyPatch) -> None:
    """With emissions that spell the text at known frames, words land on those frames (20 ms each)."""
    text = "ab, ba"
    vocab = aligner.vocab
    n_frames = 60
    path = [aligner.blank] * n_frames
    path[10], path[11], path[13] = vocab["a"], vocab["a"], vocab["b"]  # "ab" at frames 10-13
    path[25] = aligner.delimiter_id
    path[40], path[42] = vocab["b"], vocab["a"]  # "ba" at frames 40-42
    lp = _emissions(path, vocab=len(vocab)).astype(np.float32)
    monkeypatch.setattr(aligner, "log_probs", lambda pcm, sample_rate=SR: lp)
    pcm = np.zeros(int(SR * n_frames * 0.02), dtype=np.int16)
    words = aligner.align(text, pcm, SR)
    _check_spans(words, text, pcm)
    assert (words[0].start_ms, words[0].end_ms) == (200, 14 * 20 + 3 * 20)  # + 3 frames of blank tail
    assert (words[1].start_ms, words[1].end_ms) == (800, 43 * 20 + 3 * 20)


def test_aligner_phoneme_units(tmp_path: Path) -> None:
    """A phoneme vocabulary (like facebook/wav2vec2-xlsr-53-espeak-cv-ft's) reads words through the G2P."""
    from gateway.timing.devmodel import build_tiny_ctc_model

    phones = ["f", "ɪ", "ʃ", "p", "ɑː", "ə", "n", "ɐ̃", "ʊ̃", "a", "o", "l"]
    model = build_tiny_ctc_model(tmp_path / "phones", vocab=["<pad>", "<unk>", "|", *phones])
    al = CtcAligner.load(model, units="phonemes")
    assert al.units == "phonemes"
    if g2p_name().startswith("espeak-ng"):
        assert al.word_token_ids("fish", "en-us") == [al.vocab[p] for p in ("f", "ɪ", "ʃ")]
        assert al.word_token_ids("papa", "en-us") == [al.vocab[p] for p in ("p", "ɑː", "p", "ə")]
    pcm, _ = _bursty([400, 400], [200], seed=5)
    words = al.align("Olá, fish papa.", pcm, SR, language="pt-br")
    _check_spans(words, "Olá, fish papa.", pcm)
    assert all(w.source == "aligned" for w in words)


def test_aligner_falls_back_when_audio_too_short(aligner: CtcAligner) -> None:
    text = "This sentence is far too long for the tiny bit of audio it came with."
    pcm, _ = _bursty([100], [], lead_ms=20, tail_ms=20)
    words = aligner.align(text, pcm, SR)
    _check_spans(words, text, pcm)
    assert all(w.source == "estimated" for w in words)


# --- visemes --------------------------------------------------------------------------------------------------

def _check_visemes(visemes: Sequence[VisemeTiming], words: Sequence[WordTiming]) -> None:
    prev_end = 0
    for v in visemes:
        assert v.viseme in OCULUS_VISEMES
        word = words[v.word_index]
        assert word.start_ms <= v.start_ms and v.end_ms <= word.end_ms, (v, word)
        assert v.duration_ms > 0 and v.start_ms >= prev_end
        prev_end = v.end_ms
    assert {v.word_index for v in visemes} == {i for i, w in enumerate(words) if w.duration_ms > 0}


@pytest.fixture(params=["g2p", "letters"])
def g2p_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    if request.param == "letters":
        monkeypatch.setenv("GATEWAY_G2P", "letters")
    visemes_mod.cache_clear()
    yield request.param
    visemes_mod.cache_clear()


def test_visemes_en_and_pt(g2p_mode: str) -> None:
    if g2p_mode == "letters":
        assert g2p_name() == LetterG2P.name
    for text, language, bursts, gaps in [(EN, "en-us", [220, 120, 450, 300], [100, 90, 110]),
                                         (PT, "pt-br", [300, 330, 260, 200, 260, 250], [250, 120, 300, 110, 100]),
                                         (PT, "pt", [300, 330, 260, 200, 260, 250], [250, 120, 300, 110, 100])]:
        pcm, _ = _bursty(bursts, gaps)
        words = estimate_word_timings(text, pcm)
        visemes = visemes_for_words(words, language)
        _check_visemes(visemes, words)
    assert word_visemes("papa", "en-us")[0][0] == "PP"
    fish = [v for v, _ in word_visemes("fish", "en-us")]
    assert fish[0] == "FF" and ("SS" in fish or "CH" in fish)
    nao = [v for v, _ in word_visemes("não", "pt-br")]
    assert nao[0] == "nn" and "aa" in nao
    assert word_visemes("chuva", "pt-br")[0][0] == "CH"
    assert word_visemes("bem", "pt-br")[0][0] == "PP"


def test_espeak_g2p_available() -> None:
    """The venv ships espeak-ng through espeakng-loader; the fallback is for deployments without it."""
    import espeakng_loader  # noqa: F401  (dependencies: a broken install fails here, it is not skipped)
    import phonemizer  # noqa: F401

    visemes_mod.cache_clear()
    assert g2p_name().startswith("espeak-ng")
    assert visemes_mod.phonemize_word("fish", "en-us") == ("f", "ɪ", "ʃ")


def test_viseme_table_and_weights() -> None:
    assert phone_visemes("tʃ") == [("CH", 1.0)]
    assert phone_visemes("ɑː") == [("aa", 2.5)]
    assert [v for v, _ in phone_visemes("ɐ̃ʊ̃")] == ["aa", "U"]
    assert phone_visemes("w") == [("U", 1.0)]  # a glide: consonant length
    assert set(visemes_mod.IPA_TO_VISEME.values()) <= set(OCULUS_VISEMES)
    word = WordTiming("papa", 0, 4, 100, 300)
    vs = visemes_for_words([word, WordTiming("x", 5, 6, 400, 0)], "en-us")
    _check_visemes(vs, [word])
    vowels = [v.duration_ms for v in vs if v.viseme in visemes_mod.VOWEL_VISEMES]
    consonants = [v.duration_ms for v in vs if v.viseme not in visemes_mod.VOWEL_VISEMES]
    assert min(vowels) > max(consonants)
    assert vs[0].start_ms == 100 and vs[-1].end_ms == 400


# --- CPU cost (printed; what was timed is checked) ------------------------------------------------------

def test_print_cpu_costs(aligner: CtcAligner, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    text = "Well, I think we should practise the new words again tomorrow, don't you?"
    bursts = [250, 300, 200, 220, 320, 400, 260, 450, 300, 380, 240, 260]
    pcm, _ = _bursty(bursts, [300, 60, 80, 90, 70, 120, 60, 80, 350, 70, 90])
    audio_s = len(pcm) / SR
    est = _cpu_ms_per_audio_s(lambda: estimate_word_timings(text, pcm, language="en-us"), audio_s, repeat=20)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CPU time of 2 spinning threads on a shared 2-core box says little
    try:
        ali = _cpu_ms_per_audio_s(lambda: aligner.align(text, pcm, SR), audio_s, repeat=5)
    finally:
        torch.set_num_threads(threads)
    words = estimate_word_timings(text, pcm)
    visemes_for_words(words, "en-us")  # G2P loaded

    def cold() -> None:
        visemes_mod.cache_clear(keep_g2p=True)
        visemes_for_words(words, "en-us")

    vis_cold = _cpu_ms_per_audio_s(cold, audio_s, repeat=5)
    vis_warm = _cpu_ms_per_audio_s(lambda: visemes_for_words(words, "en-us"), audio_s, repeat=20)
    # What was timed did its work: a timing per word of the text, visemes of every word, the same from the cache.
    assert [w.text for w in words] == [w.text for w in split_words(text)]
    uncached = (visemes_mod.cache_clear(keep_g2p=True), visemes_for_words(words, "en-us"))[1]
    assert uncached == visemes_for_words(words, "en-us") and {v.word_index for v in uncached} == set(range(len(words)))
    assert min(est, ali, vis_cold, vis_warm) > 0
    with capsys.disabled():
        print(f"\n[timing] {audio_s:.2f} s sentence, {len(words)} words, CPU ms per second of audio: "
              f"estimate {est:.3f}; align (tiny model, 1 thread) {ali:.2f}; visemes uncached {vis_cold:.2f} / "
              f"cached {vis_warm:.3f} ({g2p_name()})")
