"""Lesson features end to end: word timings and visemes per sentence, their place in the RTP stream, the heard
report, playback rate and repeats. Real aiortc peers over loopback, the real engine on the tiny model, and a tiny
random CTC aligner (so `aligned` timings are exercised too; their accuracy is tests/test_timing*.py's business)."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import pytest

from gateway.config import GatewayConfig
from gateway.devtools.client import HeadlessPeer, ReceivedFrame
from gateway.edge.state import GatewayState
from gateway.media.output_frames import FRAME_SAMPLES
from gateway.rtc import timings as rtc_timings
from gateway.rtc.session import Session
from gateway.speech.synthesizer import Synthesizer
from gateway.timing import split_words
from tests.support import capture_pushed, running, wait_until

pytestmark = pytest.mark.engine

TWO_SENTENCES = "Good morning,  my friend!\nShall we   practise today?"
LONG_TEXT = " ".join(f"This is sentence number {i} of a long lesson." for i in range(10))
MS_48K = 48  # RTP ticks per millisecond


@pytest.fixture(scope="module")
async def server(test_config: GatewayConfig, synthesizer: Synthesizer,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, GatewayState]]:
    from gateway.timing.devmodel import build_tiny_ctc_model

    aligner = build_tiny_ctc_model(tmp_path_factory.mktemp("tiny-ctc"))
    config = dataclasses.replace(test_config, aligner_model=str(aligner))
    async with running(config, synthesizer) as (base_url, gateway):
        service = rtc_timings.timing_service(config.aligner_model)
        await wait_until(lambda: service.aligner_ready, timeout=60)
        yield base_url, gateway


@pytest.fixture()
async def peer(server: tuple[str, GatewayState], monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[HeadlessPeer]:
    # The shared 2-core CPU can make the tiny aligner slow; here its result is always waited for.
    monkeypatch.setattr(rtc_timings, "ALIGN_TIMEOUT_S", 10.0)
    p = HeadlessPeer(server[0])  # the default 500 ms jitter buffer
    await p.connect()
    yield p
    await p.close()
    assert not p.protocol_violations


def session_of(gateway: GatewayState, peer: HeadlessPeer) -> Session:
    return gateway.sessions.sessions[peer.session_id]


def kinds(peer: HeadlessPeer, utterance_id: str) -> list[tuple[str, int | None]]:
    """(type, sentence index) of the utterance's events, in arrival order."""
    return [(e.message["type"], e.message.get("index")) for e in peer.events if e.message.get("id") == utterance_id]


def all_words(peer: HeadlessPeer, utterance_id: str) -> list[dict[str, Any]]:
    return [w for e in peer.find("words", utterance_id) for w in e.message["words"]]


async def test_timings_follow_each_segment_and_index_the_text(peer: HeadlessPeer,
                                                              server: tuple[str, GatewayState]) -> None:
    """`segment` k -> `words` k + `visemes` k -> `segment` k+1 ... -> `done`; offsets index the client's text
    across `more` pieces, whitespace and all."""
    pieces = ["Good morning,  my ", "friend!\nShall we   practise today?"]
    text = "".join(pieces)
    peer.speak("t1", pieces[0], more=True)
    peer.speak("t1", pieces[1])
    done = await peer.wait_event("done", "t1", timeout=120)
    order = kinds(peer, "t1")
    segments = [i for kind, i in order if kind == "segment"]
    assert segments == [0, 1], order
    for k in segments:
        at = order.index(("segment", k))
        assert order.index(("words", k)) > at and order.index(("visemes", k)) > at, order
        end = order.index(("segment", k + 1)) if k + 1 in segments else order.index(("done", None))
        assert order.index(("words", k)) < end and order.index(("visemes", k)) < end, order

    words = all_words(peer, "t1")
    assert [w["text"] for w in words] == [w.text for w in split_words(text)]
    for w in words:
        assert text[w["char_start"]:w["char_end"]] == w["text"]
    events = [e.message for e in peer.find("words", "t1")]
    assert [e["first_word"] for e in events] == [0, len(events[0]["words"])]
    # Either source: a sentence whose random audio is shorter than its letters need (CTC: one 20 ms frame per
    # letter) is estimated; test_a_free_aligner_aligns_what_it_can covers the aligned path.
    assert {e["source"] for e in events} <= {"aligned", "estimated"}
    starts = [w["start_ms"] for w in words]
    assert starts == sorted(starts) and starts[0] >= 0
    assert all(w["start_ms"] + w["duration_ms"] <= done["audio_ms"] + 1 for w in words)
    for event in events:
        assert event["words"][0]["start_ms"] >= event["start_ms"]
    visemes = [v for e in peer.find("visemes", "t1") for v in e.message["visemes"]]
    assert visemes and all(0 <= v["word"] < len(words) for v in visemes)
    assert {v["viseme"] for v in visemes} <= {"PP", "FF", "TH", "DD", "kk", "CH", "SS", "nn", "RR", "aa", "E", "I",
                                                "O", "U"}
    # Played to the end: everything was heard.
    assert done["heard_text"] == text[:words[-1]["char_end"]] and done["last_word"] == len(words) - 1


async def test_a_free_aligner_aligns_what_it_can(peer: HeadlessPeer) -> None:
    """A one-sentence, two-letter text: the idle aligner gets it, and the shortest audio the engine makes (one
    SNAC frame, 85 ms = 4 CTC frames) always has a CTC path for H, i; so its words must say `aligned`."""
    peer.speak("a1", "Hi!")
    await peer.wait_event("done", "a1", timeout=120)
    events = [e.message for e in peer.find("words", "a1")]
    assert [e["source"] for e in events] == ["aligned"], events
    assert [w["text"] for w in events[0]["words"]] == ["Hi"]


def first_audible_at_or_after(frames: list[ReceivedFrame], rtp: int) -> ReceivedFrame:
    ordered = sorted((f for f in frames if f.rtp_timestamp is not None), key=lambda f: f.rtp_timestamp or 0)
    return next(f for f in ordered if f.audible and (f.rtp_timestamp or 0) >= rtp)


async def test_rtp_timestamps_match_what_the_receiver_sees(peer: HeadlessPeer) -> None:
    peer.speak("r1", TWO_SENTENCES)
    started = await peer.wait_event("started", "r1", timeout=120)
    done = await peer.wait_event("done", "r1", timeout=120)
    rtp0 = started["rtp_timestamp"]
    assert isinstance(rtp0, int)
    # The last frames are still in flight when `done` is sent: wait for a packet its reported length (played frames
    # and the underruns' silence) past rtp0; every frame checked below comes before it, so has come by then.
    end = round((done["audio_ms"] + done["underrun_ms"]) * MS_48K)
    await wait_until(lambda: any(end <= (f.rtp_timestamp - rtp0) % (1 << 32) < 1 << 31
                                 for f in peer.frames if f.rtp_timestamp is not None),
                     timeout=10, message=f"a packet {end} ticks or more past the utterance's first")
    received = {f.rtp_timestamp for f in peer.frames}
    assert rtp0 in received, "the utterance's first sample starts a packet the receiver got"
    # Its first frame is the first audible one: the packets before it carry the silence between utterances.
    onset = first_audible_at_or_after(peer.frames, rtp0 - 10 * FRAME_SAMPLES)
    assert onset.rtp_timestamp == rtp0
    for event in [e.message for e in peer.find("words", "r1")] + [e.message for e in peer.find("visemes", "r1")]:
        rtp = event["rtp_timestamp"]
        if event["index"] == 0:
            assert rtp == rtp0
        # Back to back in the stream but for the underruns' silence (whole frames) that began before this point.
        gaps_ms = done["underrun_ms"] if any(at < event["start_ms"] for at in done["underrun_at_ms"]) else 0.0
        offset = (rtp - rtp0) % (1 << 32)
        # Underruns add whole frames of silence: the sentence's place within its frame is that of its start_ms.
        phase = (offset - event["start_ms"] * MS_48K) % FRAME_SAMPLES
        assert min(phase, FRAME_SAMPLES - phase) <= MS_48K, (event["type"], event["index"], offset, event["start_ms"])
        assert event["start_ms"] * MS_48K - MS_48K <= offset <= (event["start_ms"] + gaps_ms) * MS_48K + MS_48K, \
            (event["type"], event["index"], offset, event["start_ms"], done["underrun_ms"])
        # The frame holding the sentence's first sample reached the receiver.
        assert rtp - (rtp - rtp0) % FRAME_SAMPLES in received


async def test_rate_and_repeat_replay_the_same_samples_without_the_engine(
        peer: HeadlessPeer, server: tuple[str, GatewayState]) -> None:
    gateway = server[1]
    session = session_of(gateway, peer)
    pushed = capture_pushed(session)
    engine = gateway.synthesizer.engine
    peer.speak("o", TWO_SENTENCES)
    original = await peer.wait_event("done", "o", timeout=120)
    requests = engine.requests_started

    peer.repeat("o", new_id="same")  # rate 1: the very samples again
    peer.repeat("o", rate=0.7)  # default id: o#r2 (the second repeat of o)
    queued = await peer.wait_event("queued", "o#r2")
    assert queued["repeat_of"] == "o"
    same = await peer.wait_event("done", "same", timeout=60)
    slow = await peer.wait_event("done", "o#r2", timeout=60)
    assert engine.requests_started == requests, "a repeat asks no engine"
    assert np.array_equal(np.concatenate(pushed["same"]), np.concatenate(pushed["o"]))
    assert same["audio_ms"] == original["audio_ms"]
    assert slow["audio_ms"] == pytest.approx(original["audio_ms"] / 0.7, abs=60)
    slow_pcm = np.concatenate(pushed["o#r2"])
    assert len(slow_pcm) == pytest.approx(len(np.concatenate(pushed["o"])) / 0.7, abs=2)
    # Timings scale with the rate; the words and their offsets stay those of the original text.
    words, slow_words = all_words(peer, "o"), all_words(peer, "o#r2")
    assert [(w["text"], w["char_start"]) for w in slow_words] == [(w["text"], w["char_start"]) for w in words]
    for w, s in zip(words, slow_words, strict=True):
        assert s["start_ms"] == pytest.approx(w["start_ms"] / 0.7, abs=25)
    assert [e.message["source"] for e in peer.find("words", "same")] == \
        [e.message["source"] for e in peer.find("words", "o")]


async def test_word_range_repeat(peer: HeadlessPeer, server: tuple[str, GatewayState]) -> None:
    peer.speak("w", TWO_SENTENCES)
    await peer.wait_event("done", "w", timeout=120)
    words = all_words(peer, "w")
    peer.repeat("w", new_id="w-part", from_word=2, to_word=4, rate=0.8)  # "my friend! Shall": across sentences
    done = await peer.wait_event("done", "w-part", timeout=60)
    part = all_words(peer, "w-part")
    assert [w["text"] for w in part] == [w["text"] for w in words[2:5]]
    assert [e.message["first_word"] for e in peer.find("words", "w-part")] == [2, 4]
    assert [e.message["text"] for e in peer.find("segment", "w-part")] == ["my friend", "Shall"]
    assert done["heard_text"] == TWO_SENTENCES[words[2]["char_start"]:words[4]["char_end"]]
    assert done["last_word"] == 4
    assert done["audio_ms"] < sum(e.message["audio_ms"] for e in peer.find("done", "w")) / 0.8


async def test_cancel_reports_the_whole_words_heard(peer: HeadlessPeer, server: tuple[str, GatewayState]) -> None:
    peer.speak("c", LONG_TEXT)
    await peer.wait_event("words", "c", timeout=120)
    first = all_words(peer, "c")[0]
    track = session_of(server[1], peer).track  # cancelled once its first word has been played
    await wait_until(lambda: (track.played_ms("c") or 0) >= first["start_ms"] + first["duration_ms"], timeout=30,
                     message=f"the first word played ({first})")
    peer.cancel("c")
    cancelled = await peer.wait_event("cancelled", "c")
    assert cancelled["played_ms"] > 0
    last = cancelled["last_word"]
    assert_heard_whole_words(cancelled, LONG_TEXT)
    words = all_words(peer, "c")
    assert all(w["start_ms"] + w["duration_ms"] <= cancelled["played_ms"] for w in words[:last + 1])
    if last + 1 < len(words):
        assert words[last + 1]["start_ms"] + words[last + 1]["duration_ms"] > cancelled["played_ms"]
    # A queued utterance that never played heard nothing.
    peer.speak("c2", LONG_TEXT)
    peer.speak("c3", "Never played.")
    await peer.wait_event("queued", "c3")
    peer.cancel()
    assert_heard_whole_words(await peer.wait_event("cancelled", "c2"), LONG_TEXT)
    assert (await peer.wait_event("cancelled", "c3")) == {"type": "cancelled", "id": "c3", "played_ms": 0.0,
                                                          "heard_text": "", "last_word": -1}


def assert_heard_whole_words(cancelled: dict[str, Any], text: str) -> None:
    """A `cancelled` event's heard text is a prefix of `text` that ends where word `last_word` ends (or nothing)."""
    heard, last = cancelled["heard_text"], cancelled["last_word"]
    assert text.startswith(heard), cancelled
    ends = [w.char_end for w in split_words(text)]
    assert -1 <= last < len(ends), cancelled
    assert (heard == "" and last == -1) or (last >= 0 and len(heard) == ends[last]), \
        f"a prefix ending at the end of word `last`: {cancelled}"


@pytest.mark.parametrize(("message", "code"), [
    ({"type": "speak", "id": "x", "text": "Hi.", "rate": 2.0}, "invalid_rate"),
    ({"type": "speak", "id": "x", "text": "Hi.", "rate": 0.49}, "invalid_rate"),
    ({"type": "speak", "id": "x", "text": "Hi.", "rate": "slow"}, "invalid_message"),
    ({"type": "repeat", "id": "nobody"}, "unknown_id"),
    ({"type": "repeat", "id": "b", "rate": 1.6}, "invalid_rate"),
    ({"type": "repeat", "id": "b", "from_word": 99}, "invalid_range"),
    ({"type": "repeat", "id": "b", "from_word": 2, "to_word": 1}, "invalid_range"),
    ({"type": "repeat", "id": "b", "from_word": -1}, "invalid_message"),
    ({"type": "repeat", "id": "b", "new_id": "b"}, "duplicate_id"),
    ({"type": "played", "id": "b"}, "invalid_message"),
])
async def test_bad_lesson_input_gets_an_error(peer: HeadlessPeer, message: dict[str, Any], code: str) -> None:
    if message["type"] == "repeat" and message["id"] == "b":
        peer.speak("b", "One two three.")
        await peer.wait_event("done", "b", timeout=120)
        if message.get("new_id") == "b":
            peer.speak("b", "Again and again.")  # "b" exists again (queued or playing) while it is repeated as "b"
    peer.send(message)
    error = await peer.wait_event("error", timeout=10)
    assert error["code"] == code, error
    assert error["message"]


async def test_played_reports_are_counted(peer: HeadlessPeer, server: tuple[str, GatewayState]) -> None:
    peer.send({"type": "played", "id": "anything", "played_ms": 1234.5})
    peer.send({"type": "ping"})
    await peer.wait_event("pong")
    assert not peer.find("error")
    async with aiohttp.ClientSession() as http, http.get(f"{server[0]}/metrics") as response:
        text = await response.text()
    assert "orpheus_client_played_seconds_count 1.0" in text
    assert 'orpheus_word_timings_total{source="' in text


@pytest.mark.parametrize("pieces", [
    ["Good morning,  my friend!\n\nShall we   practise today?"],
    ["  Olá!   Tudo ", "bem?\tEu estou\n aprendendo ", "português. "],
    ["x" * 40 + " " + "y" * 400],  # cut at a space, then hard (max_sentence_chars)
])
def test_sentences_are_located_in_the_text_as_sent(pieces: list[str]) -> None:
    from gateway.orpheus import SentenceSplitter
    from gateway.rtc.utterance import Utterance

    utterance = Utterance("u", "tara", 0.0, SentenceSplitter(120))
    for i, piece in enumerate(pieces):
        utterance.add_text(piece, more=i < len(pieces) - 1)
    sentences = []
    while (sentence := utterance.sentences.get_nowait()) is not None:
        sentences.append(sentence)
    assert len(utterance.spans) == len(sentences) > 0
    text = "".join(pieces)
    for sentence, (start, end) in zip(sentences, utterance.spans, strict=True):
        assert " ".join(text[start:end].split()) == " ".join(sentence.split())
    # Every non-space character belongs to exactly one sentence, in order (a hard cut may split a word in two).
    assert "".join("".join(text[s:e].split()) for s, e in utterance.spans) == "".join(text.split())


def test_replay_cache_keeps_the_newest_within_both_bounds() -> None:
    from gateway.rtc.replay import Recording, ReplayCache, Sentence

    def recording(uid: str, seconds: float) -> Recording:
        pcm = np.zeros(int(seconds * 24000), np.int16)
        return Recording(uid, "Hi.", "tara", "en-us", [Sentence(0, "Hi.", 0, 2, 0, 1, pcm)])

    cache = ReplayCache(max_utterances=3, max_seconds=10.0)
    for i in range(4):
        assert cache.put(recording(f"u{i}", 2.0))
    assert cache.get("u0") is None and cache.get("u3") is not None and len(cache) == 3  # by count
    assert cache.put(recording("long", 7.0))
    assert len(cache) == 2 and cache.get("u2") is None and cache.seconds == pytest.approx(9.0)  # by seconds
    assert not cache.put(recording("too-long", 10.5)) and cache.get("too-long") is None
    assert not ReplayCache(0, 60.0).put(recording("off", 1.0))


def test_cpu_costs_per_second_of_audio(tmp_path: Path) -> None:
    """Prints what docs/lesson.md states (CPU ms per second of audio); asserts only generous bounds."""
    import time

    from gateway.timing import CtcAligner, estimate_word_timings, visemes_for_words
    from gateway.timing.devmodel import build_tiny_ctc_model

    rng = np.random.default_rng(0)
    seconds = 4.0
    t = np.arange(int(seconds * 24000)) / 24000
    pcm = (rng.standard_normal(len(t)) * 3000 * (np.sin(2 * np.pi * 3 * t) > -0.3)).astype(np.int16)
    text = "Good morning, my friend! Today we will practise how to order a coffee."

    def cpu_ms(fn: Any, n: int) -> float:
        fn()
        start = time.process_time()
        for _ in range(n):
            fn()
        return (time.process_time() - start) / n * 1000 / seconds

    words = estimate_word_timings(text, pcm, language="en-us")
    estimated = cpu_ms(lambda: estimate_word_timings(text, pcm, language="en-us"), 20)
    visemes = cpu_ms(lambda: visemes_for_words(words, "en-us"), 20)
    aligner = CtcAligner.load(build_tiny_ctc_model(tmp_path / "ctc"))
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        aligned = cpu_ms(lambda: aligner.align(text, pcm, language="en-us"), 5)
    finally:
        torch.set_num_threads(threads)
    print(f"\nCPU per second of audio: estimated {estimated:.2f} ms, visemes (cached words) {visemes:.3f} ms, "
          f"aligned (tiny CTC, 1 thread) {aligned:.1f} ms")
    assert estimated < 20 and visemes < 20 and aligned < 500
