"""Estimated word timings on speech, not noise bursts: libespeak-ng (from the espeakng-loader wheel, through
ctypes) speaks English and Portuguese sentences and reports where each word starts (its WORD events); the
estimator must find those starts from the audio alone. espeakng-loader is a dependency: a broken install fails here."""

from __future__ import annotations

import ctypes
import itertools
import os
from collections.abc import Iterator

import espeakng_loader
import numpy as np
import pytest

from gateway.timing.words import estimate_word_timings, frame_levels_db, split_words, word_weight

SENTENCES = [
    ("en-us", "Hello there, my friend. It is a well-known fact."),
    ("en-us", "Well, I think we should practise the new words again tomorrow, don't you?"),
    ("en-us", "The quick brown fox jumps over the lazy dog."),
    ("en-us", "Can you repeat that, please? I didn't understand the last part."),
    ("en-us", "My favourite food is pizza, but I also like sushi and tacos."),
    ("pt-br", "Olá, tudo bem? Eu não sei."),
    ("pt-br", "Hoje vamos aprender algumas palavras novas sobre comida e bebida."),
    ("pt-br", "Você pode repetir, por favor? Eu não entendi a última parte."),
    ("pt-br", "O gato subiu no telhado, mas depois não conseguiu descer."),
]
AUDIO_OUTPUT_SYNCHRONOUS = 2
EVENT_LIST_TERMINATED = 0
EVENT_WORD = 1
ESPEAK_RATE = 1
ESPEAK_CHARS_UTF8 = 1


class _Event(ctypes.Structure):
    _fields_ = [  # the layout of espeak_EVENT
        ("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint), ("text_position", ctypes.c_int),
        ("length", ctypes.c_int), ("audio_position", ctypes.c_int), ("sample", ctypes.c_int),
        ("user_data", ctypes.c_void_p), ("id", ctypes.c_char * 8),
    ]


_Callback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.POINTER(_Event))


class _Espeak:
    """Synchronous synthesis with word events (ms from the start of the audio)."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        data_root = os.path.dirname(espeakng_loader.get_data_path())
        self.sample_rate = int(self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data_root.encode(), 0))
        assert self.sample_rate > 0
        self.chunks: list[np.ndarray] = []
        self.word_ms: list[int] = []
        self._cb = _Callback(self._on_audio)  # keep a reference: the library calls it
        self.lib.espeak_SetSynthCallback(self._cb)

    def _on_audio(self, wav: ctypes._Pointer, n: int, events: ctypes._Pointer) -> int:  # type: ignore[type-arg]
        if wav and n > 0:
            self.chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
        i = 0
        while events[i].type != EVENT_LIST_TERMINATED:
            if events[i].type == EVENT_WORD:
                self.word_ms.append(int(events[i].audio_position))
            i += 1
        return 0

    def speak(self, text: str, voice: str, rate: int) -> tuple[np.ndarray, list[int]]:
        self.chunks, self.word_ms = [], []
        assert self.lib.espeak_SetVoiceByName(voice.encode()) == 0
        self.lib.espeak_SetParameter(ESPEAK_RATE, rate, 0)
        data = text.encode("utf-8")
        self.lib.espeak_Synth(data, len(data) + 1, 0, 0, 0, ESPEAK_CHARS_UTF8, None, None)
        self.lib.espeak_Synchronize()
        pcm = np.concatenate(self.chunks) if self.chunks else np.zeros(0, dtype=np.int16)
        return pcm.astype(np.int16), list(self.word_ms)


@pytest.fixture(scope="module")
def espeak() -> Iterator[_Espeak]:
    yield _Espeak()


def _voiced_starts(pcm: np.ndarray, sample_rate: int, event_ms: list[int]) -> list[int]:
    """Each word event moved to the first voiced 10 ms frame at or after it (an event may precede a pause)."""
    levels = frame_levels_db(pcm, sample_rate)
    threshold = np.percentile(levels, 95) - 30
    starts = []
    for ms in event_ms:
        f = ms // 10
        while f < len(levels) and levels[f] < threshold:
            f += 1
        starts.append(f * 10)
    return starts


def test_estimate_against_espeak_word_events(espeak: _Espeak, capsys: pytest.CaptureFixture[str]) -> None:
    errors: list[float] = []
    baseline: list[float] = []
    for language, text in SENTENCES:
        for rate in (130, 170, 210):
            pcm, events = espeak.speak(text, language, rate)
            words = split_words(text)
            assert len(events) == len(words), (text, events)
            truth = _voiced_starts(pcm, espeak.sample_rate, events)
            timings = estimate_word_timings(text, pcm, espeak.sample_rate, language=language)
            total_ms = len(pcm) * 1000 / espeak.sample_rate
            assert [w.text for w in timings] == [w.text for w in words]
            assert all(w.duration_ms > 0 for w in timings)
            assert all(a.end_ms <= b.start_ms for a, b in itertools.pairwise(timings))
            assert timings[-1].end_ms <= total_ms
            errors += [abs(w.start_ms - t) for w, t in zip(timings, truth, strict=True)]
            weights = np.array([word_weight(w.text, language) for w in words])
            spread = np.concatenate(([0.0], np.cumsum(weights)[:-1])) / weights.sum() * total_ms
            baseline += [abs(s - t) for s, t in zip(spread, truth, strict=True)]
    err = np.array(errors)
    base = np.array(baseline)
    with capsys.disabled():
        print(f"\n[timing] estimate vs espeak-ng word starts ({len(err)} words): mean {err.mean():.0f} ms, "
              f"median {np.median(err):.0f}, p90 {np.percentile(err, 90):.0f}; spreading over the whole audio: "
              f"mean {base.mean():.0f} ms")
    assert err.mean() < 85.0
    assert np.median(err) < 60.0
    assert err.mean() < 0.75 * base.mean()
