"""Sliding windows and the batched SNAC decoder on a random-weight SNAC (no engine)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.orpheus import SAMPLES_PER_FRAME, Frame, frames_to_layers
from gateway.speech.codec import DecodeBatcher, DecodeWindow, SnacModel, StreamWindower, decode_windows
from tests.support import first_window, make_frames, take_all

FAST = settings(deadline=None, database=None, max_examples=400, suppress_health_check=[HealthCheck.too_slow])




def kept(window: DecodeWindow) -> tuple[Frame, ...]:
    return window.frames[window.keep_from:window.keep_from + window.keep_count]






@pytest.mark.parametrize(("context", "lookahead", "hop", "max_hop"),
                         [(1, 1, 1, 1), (1, 1, 1, 4), (2, 2, 1, 3), (1, 2, 4, 4), (0, 0, 1, 2), (2, 1, 3, 5)])
@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_windows_cover_every_frame_once(context: int, lookahead: int, hop: int, max_hop: int, n: int) -> None:
    """First and last frames included, no frame twice, when every frame is taken as soon as it arrives."""
    windower = StreamWindower(context, lookahead, hop, max_hop)
    frames = make_frames(n)
    emitted: list[Frame] = []
    for i, frame in enumerate(frames):
        windower.push([frame])
        for w in take_all(windower):
            assert w.length <= context + max_hop + lookahead
            emitted += kept(w)
        if i == 0 and lookahead == 0:
            assert emitted, "with no lookahead the first frame is emitted at once"
    for w in take_all(windower, final=True):
        emitted += kept(w)
    assert emitted == frames


# One stream's life: frames arrive in bursts of any size, the decoder comes back (a round is taken) at any time.
arrivals = st.lists(st.tuples(st.integers(0, 6), st.booleans()), max_size=25)


@FAST
@given(context=st.integers(0, 2), lookahead=st.integers(0, 2), hop=st.integers(1, 3), extra=st.integers(0, 3),
       first=st.one_of(st.none(), st.integers(0, 2)), ops=arrivals, rounds=st.booleans(), patient=st.booleans())
def test_any_arrival_pattern_emits_every_frame_once(context: int, lookahead: int, hop: int, extra: int,
                                                     first: int | None, ops: list[tuple[int, bool]],
                                                     rounds: bool, patient: bool) -> None:
    max_hop = hop + extra
    windower = StreamWindower(context, lookahead, hop, max_hop, first_lookahead=first)
    frames = make_frames(sum(k for k, _ in ops), seed=len(ops))
    lengths = set(windower.window_lengths())
    pushed = 0
    emitted: list[Frame] = []

    def check(window: DecodeWindow, final: bool) -> None:
        before = len(emitted)
        assert 1 <= window.keep_count <= max_hop
        assert window.keep_from == min(context, before), "full left context once there is one"
        assert window.frames == tuple(frames[before - window.keep_from:before - window.keep_from + window.length])
        if not final:
            right = lookahead if before > 0 or first is None else first
            assert window.length - window.keep_from - window.keep_count == right, "right context waited for"
            if before > 0:
                assert window.keep_count >= hop
                if patient:
                    assert window.keep_count == max_hop, "a patient stream decodes whole windows"
            if before == 0 or before >= context:
                assert window.length in lengths, "a length CUDA graphs are captured for"
        emitted.extend(kept(window))

    for count, take in ops:
        windower.push(frames[pushed:pushed + count])
        pushed += count
        if take:
            taken = (windower.take_round(patient=patient) if rounds
                     else [w for w in [windower.take(patient=patient)] if w is not None])
            for w in taken:
                check(w, final=False)
            if rounds and taken:
                assert windower.ready() < max_hop, "a round leaves less than max_hop frames behind"
    for w in windower.take_round(final=True):
        check(w, final=True)
    assert emitted == frames
    assert windower.take(final=True) is None


def test_first_window_may_skip_its_lookahead() -> None:
    windower = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    windower.start_early()
    windower.push(make_frames(1))
    first = windower.take()
    assert first is not None and first.length == 1 and first.keep_count == 1, "first frame at once"
    windower.push(make_frames(1, seed=1))
    assert windower.take() is None, "later frames wait for their lookahead"
    windower.start_early()  # too late: no effect once audio went out
    assert windower.first_lookahead == 0 and windower.ready() == 0
    fresh = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    assert 1 not in fresh.window_lengths() and 1 in fresh.window_lengths(early_start=True)


def test_first_audio_waits_only_for_lookahead() -> None:
    windower = StreamWindower(context=1, lookahead=1, hop=4, max_hop=4)
    windower.push(make_frames(1))
    assert windower.take() is None
    windower.push(make_frames(1, seed=1))
    first = windower.take()
    assert first is not None and first.keep_count == 1 and first.keep_from == 0


def test_first_window_is_small_even_with_a_backlog() -> None:
    """First audio as soon as possible: the first window emits `hop` frames, however many are waiting."""
    windower = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    windower.push(make_frames(4))
    first = windower.take()
    assert first is not None and (first.keep_count, first.length) == (1, 2)


def test_steady_windows_have_equal_length() -> None:
    """Equal lengths are what lets the decoder stack windows of different streams into one batch."""
    windower = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    lengths = []
    for f in make_frames(20):
        windower.push([f])
        lengths += [w.length for w in take_all(windower)]
    assert set(lengths[1:]) == {3}, "taken at once, the hop stays 1 (light load)"


@pytest.mark.parametrize("every", [2, 3, 4, 6])
def test_hop_grows_when_takes_are_delayed(every: int) -> None:
    """A busy decoder comes back every few frames: the next window covers all of them, up to max_hop."""
    windower = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    frames = make_frames(40)
    windower.push(frames[:2])
    assert windower.take() is not None  # the first window, at once
    hops, lengths = [], []
    for i in range(2, 40):
        windower.push([frames[i]])
        if i % every == 0:
            window = windower.take()
            assert window is not None
            hops.append(window.keep_count)
            lengths.append(window.length)
    assert set(hops[1:]) == {min(every, 4)}
    assert set(lengths[1:]) == {2 + min(every, 4)}, "context + hop + lookahead"


def test_max_hop_caps_windows_and_a_round_catches_up_in_whole_windows() -> None:
    windower = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    windower.push(make_frames(2))
    assert windower.take() is not None
    windower.push(make_frames(10, seed=1))  # 10 ready (the last frame waits for its lookahead)
    round_ = windower.take_round()
    assert [w.keep_count for w in round_] == [4, 4], "whole max_hop windows; 2 frames wait for the next round"
    assert [w.length for w in round_] == [6, 6]
    assert windower.ready() == 2
    assert [w.keep_count for w in windower.take_round()] == [2]
    assert windower.take_round() == []


def test_min_hop_holds_windows_back_until_final() -> None:
    windower = StreamWindower(context=1, lookahead=1, hop=3, max_hop=5)
    windower.push(make_frames(2))
    assert windower.take() is not None  # first window: 1 frame
    windower.push(make_frames(2, seed=1))
    assert windower.take() is None, "2 ready frames < hop 3"
    windower.push(make_frames(1, seed=2))
    window = windower.take()
    assert window is not None and window.keep_count == 3
    windower.push(make_frames(1, seed=3))
    assert windower.take() is None
    tail = windower.take_round(final=True)
    assert [w.keep_count for w in tail] == [2], "the tail goes at the end, shorter than hop, last frame included"
    assert tail[0].keep_from + tail[0].keep_count == tail[0].length, "no right context after the last frame"


def test_final_flush_takes_the_rest_in_max_hop_windows() -> None:
    windower = StreamWindower(context=1, lookahead=1, hop=1, max_hop=4)
    frames = make_frames(11)
    windower.push(frames)
    emitted = list(kept(windower.take()))  # type: ignore[arg-type]
    tail = windower.take_round(final=True)
    assert [w.keep_count for w in tail] == [4, 4, 2]
    emitted += [f for w in tail for f in kept(w)]
    assert emitted == frames


def test_window_lengths_for_graph_capture() -> None:
    assert StreamWindower(1, 1, 1, 1).window_lengths() == [2, 3]
    assert StreamWindower(1, 1, 1, 4).window_lengths() == [2, 3, 4, 5, 6]
    assert StreamWindower(0, 0, 1, 2).window_lengths() == [1, 2]
    assert StreamWindower(2, 1, 2, 3).window_lengths() == [2, 3, 4, 5, 6]
    assert StreamWindower(1, 1, hop=3).max_hop == 3, "max_hop is at least hop"


@pytest.fixture(scope="module")
def snac(tmp_path_factory: pytest.TempPathFactory) -> SnacModel:
    from gateway.devtools.devmodels import build_test_snac

    path: Path = build_test_snac(tmp_path_factory.mktemp("snac"))
    return SnacModel.load(str(path), "cpu")


def test_decode_batch_shapes(snac: SnacModel) -> None:
    windower = StreamWindower(1, 1, 1)
    windower.push(make_frames(4))
    windows = take_all(windower)
    assert [w.length for w in windows] == [2, 3, 3]
    pcm = decode_windows(snac, windows[1:3])
    assert [len(p) for p in pcm] == [SAMPLES_PER_FRAME, SAMPLES_PER_FRAME]
    assert all(p.dtype == np.int16 for p in pcm)
    assert any(np.abs(p).max() > 0 for p in pcm)


def test_batched_decode_equals_decoding_each_window_alone(snac: SnacModel) -> None:
    """The batch path (one code array per batch, conversion to int16 on the device) gives each window the
    samples SNAC makes for that window by itself, from its layers as `frames_to_layers` orders them."""
    import torch
    from snac.layers import NoiseBlock

    noise = [m for m in snac.model.modules() if isinstance(m, NoiseBlock)]
    for m in noise:  # SNAC adds fresh noise on every call; without it two decodes can be compared
        m.forward = lambda x: x  # type: ignore[method-assign]
    try:
        windower = StreamWindower(1, 1, 1)
        windower.push(make_frames(6, seed=3))
        windows = [w for w in take_all(windower) if w.length == 3]
        pcm = decode_windows(snac, windows)
        for window, samples in zip(windows, pcm, strict=True):
            layers = [torch.tensor([layer]) for layer in frames_to_layers(window.frames)]
            with torch.inference_mode():
                audio = snac.model.decode(layers)[0, 0].clamp(-1.0, 1.0) * 32767
            keep = audio[window.keep_from * SAMPLES_PER_FRAME:(window.keep_from + window.keep_count)
                         * SAMPLES_PER_FRAME].to(torch.int16).numpy()
            assert np.abs(samples.astype(np.int32) - keep.astype(np.int32)).max() <= 1
    finally:
        for m in noise:
            del m.forward


async def test_batcher_batches_concurrent_streams(snac: SnacModel) -> None:
    sizes: list[int] = []
    batcher = DecodeBatcher(snac, max_batch=64, on_batch=lambda size, _s, _length, _new: sizes.append(size))
    try:
        windows = [first_window(make_frames(3, seed=s)) for s in range(6)]
        results = await asyncio.gather(*(batcher.decode(w) for w in windows))
        assert all(len(r) == SAMPLES_PER_FRAME for r in results)
        assert max(sizes) > 1, "windows waiting together are decoded in one pass"
        assert sum(sizes) == 6
    finally:
        batcher.close()


async def test_batcher_error_fails_only_that_batch(snac: SnacModel) -> None:
    batcher = DecodeBatcher(snac, max_batch=8)
    try:
        bad = first_window([(5000, 0, 0, 0, 0, 0, 0)], 0, 0)  # code out of the codebook
        with pytest.raises(RuntimeError, match="audio decoding failed"):
            await batcher.decode(bad)
        good = first_window(make_frames(1), 0, 0)
        assert len(await batcher.decode(good)) == SAMPLES_PER_FRAME
    finally:
        batcher.close()


async def test_decode_many_keeps_order_and_counts_frames(snac: SnacModel) -> None:
    """A round of one stream (windows of two lengths) comes back in order; the stats count new frames apart
    from the frames decoded, whose ratio is the recomputation."""
    passes: list[tuple[int, int, int]] = []
    batcher = DecodeBatcher(snac, max_batch=64,
                            on_batch=lambda size, _s, length, new: passes.append((size, length, new)))
    try:
        windower = StreamWindower(1, 1, 1, 4)
        windower.push(make_frames(12))
        windows = [windower.take(), *windower.take_round()]
        assert [w.keep_count for w in windows] == [1, 4, 4]  # type: ignore[union-attr]
        pcm = await batcher.decode_many(windows)  # type: ignore[arg-type]
        assert [len(p) for p in pcm] == [SAMPLES_PER_FRAME, 4 * SAMPLES_PER_FRAME, 4 * SAMPLES_PER_FRAME]
        assert len(await batcher.decode(windows[1])) == 4 * SAMPLES_PER_FRAME  # type: ignore[arg-type]
        assert sorted(passes) == [(1, 2, 1), (1, 6, 4), (2, 6, 8)], "one pass per length"
        stats = batcher.stats
        assert (stats.windows, stats.frames, stats.window_frames) == (4, 13, 2 + 6 * 3)
    finally:
        batcher.close()


class GatedDecoder:
    """The real decoder, whose passes wait until the test opens the gate (so rounds queue up meanwhile)."""

    def __init__(self, snac: SnacModel) -> None:
        self.snac = snac
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.rows = 0

    def decode_codes(self, codes: np.ndarray, frames: int) -> np.ndarray:
        self.entered.set()
        self.gate.wait(timeout=30)
        self.rows += len(codes)
        return self.snac.decode_codes(codes, frames)


async def test_cancelled_round_is_skipped(snac: SnacModel) -> None:
    decoder = GatedDecoder(snac)
    batcher = DecodeBatcher(decoder, max_batch=8)
    try:
        busy = asyncio.ensure_future(batcher.decode(first_window(make_frames(3, seed=9))))
        assert await asyncio.to_thread(decoder.entered.wait, 30), "the first pass is running"
        windows = [first_window(make_frames(3, seed=s)) for s in range(3)]
        task = asyncio.ensure_future(batcher.decode_many(windows))  # queued behind the running pass
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        decoder.gate.set()
        await busy
        assert len(await batcher.decode(windows[0])) == SAMPLES_PER_FRAME, "the worker goes on"
        assert batcher.stats.skipped == 3, "the cancelled round never reached the model"
        assert decoder.rows == 2, "only the running pass and the last window were decoded"
    finally:
        batcher.close()


def test_batcher_keeps_a_round_together_within_max_batch(snac: SnacModel) -> None:
    """A pass never exceeds max_batch: a round that does not fit waits for the next pass."""
    sizes: list[int] = []
    batcher = DecodeBatcher(snac, max_batch=4, on_batch=lambda size, _s, _length, _new: sizes.append(size))

    async def main() -> None:
        rounds = [[first_window(make_frames(2, seed=10 * r + s), 1, 1) for s in range(3)] for r in range(3)]
        results = await asyncio.gather(*(batcher.decode_many(r) for r in rounds))
        assert [len(r) for r in results] == [3, 3, 3]

    try:
        asyncio.run(main())
        assert sum(sizes) == 9 and max(sizes) <= 4
    finally:
        batcher.close()


def test_snac_runs_in_bfloat16_on_a_gpu_and_float32_on_cpu_unless_told() -> None:
    """`--snac-dtype auto` (the default): bfloat16 where SNAC runs on CUDA (measured faster with more streams real
    time), float32 on CPU; a named dtype is kept. `--snac-device auto` is CUDA only when there is one."""
    import torch

    from gateway.config import from_sources
    from gateway.speech.codec import GPU_SNAC_DTYPE, snac_device_and_dtype

    assert from_sources(env={}).snac_dtype == "auto" and GPU_SNAC_DTYPE == "bfloat16"
    assert snac_device_and_dtype("cuda:1", "auto") == ("cuda:1", "bfloat16")
    assert snac_device_and_dtype("cpu", "auto") == ("cpu", "float32")
    assert snac_device_and_dtype("cuda", "float32") == ("cuda", "float32")
    assert snac_device_and_dtype("auto", "auto") == (("cuda", "bfloat16") if torch.cuda.is_available()
                                                     else ("cpu", "float32"))
