"""Sliding windows and the batched SNAC decoder on a random-weight SNAC (no engine)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from gateway.codec import DecodeBatcher, SnacModel, StreamWindower
from gateway.orpheus import SAMPLES_PER_FRAME, Frame


def make_frames(n: int, seed: int = 0) -> list[Frame]:
    rng = np.random.default_rng(seed)
    return [tuple(int(c) for c in rng.integers(0, 4096, 7)) for _ in range(n)]  # type: ignore[misc]


@pytest.mark.parametrize(("context", "lookahead", "hop"), [(1, 1, 1), (2, 2, 1), (1, 2, 4), (0, 0, 1), (2, 1, 3)])
@pytest.mark.parametrize("n", [1, 2, 3, 9])
def test_windows_cover_every_frame_once(context: int, lookahead: int, hop: int, n: int) -> None:
    """First and last frames included, no frame twice, whatever sizes the frames arrive in."""
    windower = StreamWindower(context, lookahead, hop)
    frames = make_frames(n)
    emitted: list[Frame] = []
    for i, frame in enumerate(frames):
        for w in windower.push([frame]):
            assert w.length <= context + hop + lookahead
            emitted += w.frames[w.keep_from:w.keep_from + w.keep_count]
        if i == 0 and lookahead == 0:
            assert emitted, "with no lookahead the first frame is emitted at once"
    for w in windower.push([], final=True):
        emitted += w.frames[w.keep_from:w.keep_from + w.keep_count]
    assert emitted == frames


def test_first_audio_waits_only_for_lookahead() -> None:
    windower = StreamWindower(context=1, lookahead=1, hop=4)
    assert windower.push(make_frames(1)) == []
    first = windower.push(make_frames(1, seed=1))
    assert len(first) == 1 and first[0].keep_count == 1 and first[0].keep_from == 0


def test_steady_windows_have_equal_length() -> None:
    """Equal lengths are what lets the decoder stack windows of different streams into one batch."""
    windower = StreamWindower(context=1, lookahead=1, hop=1)
    lengths = [w.length for f in make_frames(20) for w in windower.push([f])]
    assert set(lengths[1:]) == {3}


@pytest.fixture(scope="module")
def snac(tmp_path_factory: pytest.TempPathFactory) -> SnacModel:
    from gateway.devmodels import build_test_snac

    path: Path = build_test_snac(tmp_path_factory.mktemp("snac"))
    return SnacModel.load(str(path), "cpu")


def test_decode_batch_shapes(snac: SnacModel) -> None:
    windower = StreamWindower(1, 1, 1)
    windows = windower.push(make_frames(4))
    pcm = snac.decode(windows[1:3])
    assert [len(p) for p in pcm] == [SAMPLES_PER_FRAME, SAMPLES_PER_FRAME]
    assert all(p.dtype == np.int16 for p in pcm)
    assert any(np.abs(p).max() > 0 for p in pcm)


async def test_batcher_batches_concurrent_streams(snac: SnacModel) -> None:
    sizes: list[int] = []
    batcher = DecodeBatcher(snac, max_batch=64, on_batch=lambda size, _s: sizes.append(size))
    try:
        windows = [StreamWindower(1, 1, 1).push(make_frames(3, seed=s))[0] for s in range(6)]
        results = await asyncio.gather(*(batcher.decode(w) for w in windows))
        assert all(len(r) == SAMPLES_PER_FRAME for r in results)
        assert max(sizes) > 1, "windows waiting together are decoded in one pass"
        assert sum(sizes) == 6
    finally:
        batcher.close()


async def test_batcher_error_fails_only_that_batch(snac: SnacModel) -> None:
    batcher = DecodeBatcher(snac, max_batch=8)
    try:
        bad = StreamWindower(0, 0, 1).push([(5000, 0, 0, 0, 0, 0, 0)])[0]  # code out of the codebook
        with pytest.raises(RuntimeError, match="audio decoding failed"):
            await batcher.decode(bad)
        good = StreamWindower(0, 0, 1).push(make_frames(1))[0]
        assert len(await batcher.decode(good)) == SAMPLES_PER_FRAME
    finally:
        batcher.close()
