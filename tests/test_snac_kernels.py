"""The fused Triton kernels of the exact streaming SNAC step (gateway/speech/snac/kernels.py) against the
layer-by-layer step and `snac.SNAC.decode`, on a CPU through Triton's interpreter (float32, so exact up to float
rounding). On the card the same comparison runs in bfloat16 (tools/device/snac_stream_bench.py `check`).
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gateway.devtools.snac_reference import reference_decode
from gateway.speech.snac import StreamingSnac
from gateway.speech.snac.graphs import snac_kernels
from tests.support import make_frames

EXACT = 1e-5  # float32 max abs difference that counts as exact (the layer-by-layer step's own bound)


@pytest.fixture(scope="module")
def interpreted() -> Iterator[None]:
    """Triton's interpreter for this module's kernels: they run on CPU tensors (numpy underneath). Triton decides
    interpreted or compiled when a function is decorated, so the kernel's module is loaded again under the
    variable (an earlier test may have imported it, or triton, without it) and once more after."""
    from gateway.speech.snac import head_kernel, kernels, unit_kernel

    def reload() -> None:
        for module in (unit_kernel, head_kernel):
            importlib.reload(module)
        kernels._unit_kernel.cache_clear()
        kernels._head_kernel.cache_clear()

    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_INTERPRET", "1")
    reload()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    patch.undo()
    reload()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def snac_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from snac import SNAC

    from gateway.devtools.devmodels import build_test_snac

    path: Path = build_test_snac(tmp_path_factory.mktemp("snac-kernels"))
    return SNAC.from_pretrained(str(path)).eval()


def stream_all(snac: StreamingSnac, utterances: list[tuple[list, int]], bursts: list[int]) -> list[np.ndarray]:
    """Every utterance decoded together, frames pushed in `bursts` per tick, one `step_batch` per tick (so steps
    mix rows at the start edge, in the middle and flushing past the end)."""
    handles = [snac.open_stream(seed) for _, seed in utterances]
    pieces: list[list[np.ndarray]] = [[] for _ in utterances]
    pushed = [0] * len(utterances)
    tick = 0
    while not all(snac.done(h) for h in handles):
        for i, ((frames, _), h) in enumerate(zip(utterances, handles, strict=True)):
            if not h.finished:
                burst = bursts[(tick + i) % len(bursts)]
                snac.push(h, frames[pushed[i]:pushed[i] + burst])
                pushed[i] = min(len(frames), pushed[i] + burst)
                if pushed[i] == len(frames):
                    snac.finish(h)
        for i, piece in enumerate(snac.step_batch(handles, as_float=True)):
            pieces[i].append(piece)
        tick += 1
    for h in handles:
        snac.close(h)
    return [np.concatenate(p) for p in pieces]


@pytest.mark.parametrize("heads", [False, True], ids=["units", "units+heads"])
def test_fused_units_are_exact(interpreted: None, snac_model: torch.nn.Module, heads: bool) -> None:
    """Streams of 1 and 5 frames through the fused residual units (and with `heads` the fused block heads),
    batched with one another: the audio equals the full `SNAC.decode` (position-tied noise) and the
    layer-by-layer step, edges included (masked steps at the start and the flush, unmasked ones in between)."""
    utterances = [(make_frames(n, seed=n), 500 + n) for n in (1, 5)]
    fused = StreamingSnac(snac_model, "cpu", "float32", max_streams=4, kernels=True, head_kernels=heads)
    layered = StreamingSnac(snac_model, "cpu", "float32", max_streams=4)
    assert fused.decoder.kernels and not layered.decoder.kernels
    assert fused.decoder.head_kernels == heads and fused.decoder.state_shapes == layered.decoder.state_shapes
    got = stream_all(fused, utterances, [1, 2])
    want = stream_all(layered, utterances, [1, 2])
    for (frames, seed), a, b in zip(utterances, got, want, strict=True):
        reference = reference_decode(snac_model, [frames], [seed])[0]
        assert a.shape == reference.shape
        assert np.abs(a - b).max() < EXACT
        assert np.abs(a - reference).max() < EXACT


def test_kernels_are_on_where_they_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--snac-kernels` unset: on where they run, CUDA with Triton (docs/decisions/snac-kernels.md: faster than
    the compiled step), off on a CPU; asked for on a CPU, a clear error; turned off by name, off."""
    from gateway.speech.snac import kernels

    assert snac_kernels("cpu", None) is False
    assert snac_kernels("cpu", False) is False
    with pytest.raises(ValueError, match="needs CUDA and Triton"):
        snac_kernels("cpu", True)
    monkeypatch.setattr(kernels, "kernels_available", lambda device: device.type == "cuda")  # a GPU host's answer
    assert snac_kernels("cuda", None) is True
    assert snac_kernels("cuda", False) is False
    assert snac_kernels("cpu", None) is False


@pytest.mark.parametrize(("channels", "length", "dilation"), [(64, 150, 9), (128, 40, 3), (256, 33, 1)])
def test_unit_kernel_in_the_cards_tiles(interpreted: None, channels: int, length: int, dilation: int) -> None:
    """The kernel in the tiles it runs in on a card (`unit_tiles`: several time tiles, a partial last one, the
    input channels in blocks) against the unit written with torch's own layers, masked and not."""
    from snac.layers import snake
    from torch.nn import functional as nnf

    from gateway.speech.snac.kernels import residual_unit, unit_tiles

    g = torch.Generator().manual_seed(channels + length)
    batch, pad = 3, 3 * dilation
    x, old_snake, old_x = (torch.randn(batch, channels, n, generator=g) for n in (length, 2 * pad, pad))
    alpha1, alpha2 = (torch.rand(1, channels, 1, generator=g) + 0.5 for _ in range(2))
    dw_w, dw_b = torch.randn(channels, 1, 7, generator=g) * 0.3, torch.randn(channels, generator=g)
    pw_w, pw_b = torch.randn(channels, channels, 1, generator=g) / channels ** 0.5, torch.randn(channels, generator=g)
    frame, end, per_frame, delay = torch.tensor([0, 3, 9]), torch.tensor([1 << 40, 4, 1 << 40]), length, 2 * pad
    joined = torch.cat([old_snake, snake(x, alpha1)], dim=2)
    y = nnf.conv1d(joined, dw_w, dw_b, dilation=dilation, groups=channels)
    y = nnf.conv1d(snake(y, alpha2), pw_w, pw_b) + torch.cat([old_x, x[..., :length - pad]], dim=2)
    pos = (frame * per_frame - delay)[:, None] + torch.arange(length)[None, :]
    valid = ((pos >= 0) & (pos < (end * per_frame)[:, None]))[:, None, :]
    tiles = unit_tiles(channels, length)
    assert tiles[1] < length or tiles[3] < channels  # more than one tile or input block: the card's loops run
    streams_side_by_side = (2, 16, min(channels, 64), 32, 4)  # two streams a tile, the last tile half empty
    for masked, tried in itertools.product((False, True), (tiles, streams_side_by_side)):
        got = residual_unit(joined, x, old_x, alpha2, dw_w, dw_b, pw_w, pw_b, dilation, frame, end, per_frame, delay,
                            masked, tiles=tried)
        want = y * valid if masked else y
        assert (got - want).abs().max() < EXACT * 10, tried  # sums over up to 256 channels: float32 rounding


# SNAC 24 kHz's block heads (input channels, stride), each with a length of new inputs that is not a multiple of
# the card's tile: a partial tile of side-by-side streams (5, 33), several time tiles and a partial last (70, 150).
BLOCK_HEADS = [(1024, 8, 5), (512, 8, 33), (256, 4, 70), (128, 2, 150)]


@pytest.mark.parametrize(("channels", "stride", "length"), BLOCK_HEADS)
def test_block_head_kernel_is_the_steps_head(interpreted: None, channels: int, stride: int, length: int) -> None:
    """The fused head (Snake in the loads, the transposed convolution as phases) against the step's own:
    `_ConvT.step` over the kept Snake output then the Snake of the new inputs, in the card's tiles and the
    interpreter's, with bias and without."""
    from gateway.speech.snac.kernels import block_head, head_phases, head_tiles
    from gateway.speech.snac.layers import _ConvT, _Snake

    g = torch.Generator().manual_seed(channels + length)
    batch, out_channels = 3, channels // 2
    weight = torch.randn(channels, out_channels, 2 * stride, generator=g) * channels ** -0.5
    bias, alpha = torch.randn(out_channels, generator=g), torch.rand(1, channels, 1, generator=g) + 0.5
    x, kept = torch.randn(batch, channels, length, generator=g), torch.randn(batch, channels, 1, generator=g)
    phases = head_phases(weight, stride)
    tiles = head_tiles(channels, out_channels, stride, length)
    assert length % tiles[1] or tiles[0] > 1  # a partial tile: the masks run
    for b, tried in ((bias, tiles), (None, None)):
        up = _ConvT(weight, b, stride, stride // 2, 0)
        want = up.step(torch.cat([kept, _Snake(alpha)(x)], dim=2))
        got = block_head(kept, x, alpha, phases, b, stride, tiles=tried)
        assert got.shape == want.shape == (batch, out_channels, length * stride) and got.is_contiguous()
        assert (got - want).abs().max() < EXACT * 10, tried  # sums over up to 2048 products: float32 rounding


def test_head_kernels_continue_the_layered_steps_streams(interpreted: None, snac_model: torch.nn.Module) -> None:
    """The fused heads keep the layer-by-layer step's state (the kept Snake outputs): a stream stepped by either
    path in turn has, after each step, the audio and the state of the layered step alone."""
    from gateway.speech.snac.layers import OPEN_END, DecoderLayers

    cpu = torch.device("cpu")
    layered = DecoderLayers(snac_model, cpu, torch.float32)
    heads = DecoderLayers(snac_model, cpu, torch.float32, head_kernels=True)
    codes = torch.tensor(make_frames(4, seed=9), dtype=torch.int64)[None]
    seeds, end = torch.tensor([77]), torch.tensor([OPEN_END])
    alone = mixed = torch.zeros(1, layered.state_size)
    with torch.inference_mode():
        for k in range(codes.shape[1]):
            frame = torch.tensor([k])
            want, alone = layered.stream(alone, codes[:, k:k + 1], frame, end, seeds)
            got, mixed = (heads if k % 2 else layered).stream(mixed, codes[:, k:k + 1], frame, end, seeds)
            assert (got - want).abs().max() < EXACT and (mixed - alone).abs().max() < EXACT, k
