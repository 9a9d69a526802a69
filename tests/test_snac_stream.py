"""The exact streaming SNAC decoder (gateway/speech/snac/) against `snac.SNAC.decode` on a random-weight
24 kHz SNAC, CPU only. References use the same position-tied noise (`reference_decode`).

Set SNAC_STREAM_ALL_LENGTHS=1 to check every utterance length 1..40 (about a minute more on 2 cores); the default
run checks 1..12, 17, 25 and 40 (every interaction of the start and end edges: beyond ~5 frames they are apart).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from gateway.benchmarks.start_policies import BRIDGE_HELD
from gateway.devtools.snac_reference import reference_decode
from gateway.orpheus import SAMPLES_PER_FRAME, Frame, frames_to_layers
from gateway.speech.first_audio import (
    BRIDGE_PACE_FACTOR,
    EXACT_START_MARGIN_S,
    EXACT_START_PREFERENCE_S,
    FRAME_S,
    LONE_FAST_START_S,
    MAX_START_HOLD_S,
    GenerationPace,
    bridged_start_hold_s,
    exact_start_hold_s,
    fast_start_in_time,
    fast_start_margin_s,
    start_hold_s,
    starts_exact,
)
from gateway.speech.snac import (
    GPU_SNAC_DTYPE,
    MAX_HEAD_FRAMES,
    OPEN_END,
    StreamHandle,
    StreamingSnac,
    position_noise,
    snac_compiles,
    snac_device_and_dtype,
)
from gateway.speech.stream_decoder import BRIDGE_CROSSFADE, STEPS_BEFORE_AUDIO, DecodeStream, StreamDecoder
from tests.support import ManualClock, decoded_audio, make_frames, wait_until

EXACT = 1e-5  # float32 max abs difference that counts as exact (measured: ~6e-7; audio peaks ~0.7)
BF16_MIN_SNR_DB = 33.0  # measured 39 dB on CPU (40 dB on an H200 for windowed decodes); see test_half_precision_snr
FP16_MIN_SNR_DB = 50.0  # measured 58 dB on CPU (56 dB on an H200)

LENGTHS = list(range(1, 41)) if os.environ.get("SNAC_STREAM_ALL_LENGTHS") else [*range(1, 13), 17, 25, 40]
PATTERNS = ([1], [1, 3, 2], [2], [3, 1], [1, 1, 5], [4])  # frames pushed per tick, cycled


def snr_db(reference: np.ndarray, other: np.ndarray) -> float:
    return float(10 * np.log10(np.sum(reference ** 2) / max(np.sum((other - reference) ** 2), 1e-30)))


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread for this module: on a busy 2-core machine (other test processes running) torch's two
    spinning OpenMP threads made this file take 400 s instead of 23 s; on an idle one the difference is small."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def snac_model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    from snac import SNAC

    from gateway.devtools.devmodels import build_test_snac

    path: Path = build_test_snac(tmp_path_factory.mktemp("snac-stream"))
    return SNAC.from_pretrained(str(path)).eval()


@pytest.fixture(scope="module")
def decoder(snac_model: torch.nn.Module) -> StreamingSnac:
    return StreamingSnac(snac_model, "cpu", "float32", max_streams=64)


@dataclass
class Utterance:
    frames: list[Frame]
    seed: int
    reference: np.ndarray  # full SNAC decode, float32
    streamed: np.ndarray | None = None
    handle: StreamHandle | None = None


@pytest.fixture(scope="module")
def utterances(snac_model: torch.nn.Module) -> dict[int, Utterance]:
    out: dict[int, Utterance] = {}
    for n in LENGTHS:
        frames, seed = make_frames(n, seed=n), 1000 + n
        out[n] = Utterance(frames, seed, reference_decode(snac_model, [frames], [seed])[0])
    return out


@pytest.fixture(scope="module")
def streamed(decoder: StreamingSnac, utterances: dict[int, Utterance]) -> dict[int, Utterance]:
    """All lengths decoded together: streams start at different ticks, frames arrive in irregular bursts, one
    `step_batch` per tick for every open stream (a stream with a backlog advances one frame per tick)."""
    pieces: dict[int, list[np.ndarray]] = {n: [] for n in utterances}
    handles: dict[int, StreamHandle] = {}
    pushed = dict.fromkeys(utterances, 0)
    tick = 0
    while len(handles) < len(utterances) or not all(decoder.done(h) for h in handles.values()):
        for index, (n, utt) in enumerate(utterances.items()):
            if tick < index % 5:  # staggered starts: streams sit at different positions in each batch
                continue
            if n not in handles:
                handles[n] = decoder.open_stream(utt.seed)
            h = handles[n]
            if not h.finished:
                pattern = PATTERNS[index % len(PATTERNS)]
                burst = pattern[(tick - index % 5) % len(pattern)]
                decoder.push(h, utt.frames[pushed[n]:pushed[n] + burst])
                pushed[n] = min(n, pushed[n] + burst)
                if pushed[n] == n:
                    decoder.finish(h)
        order = list(handles)
        for n, piece in zip(order, decoder.step_batch([handles[n] for n in order], as_float=True), strict=True):
            pieces[n].append(piece)
        tick += 1
    for n, utt in utterances.items():
        utt.streamed = np.concatenate(pieces[n])
        utt.handle = handles[n]
        decoder.close(handles[n])
    return utterances


def decode_alone(decoder: StreamingSnac, frames: list[Frame], seed: int, burst: int = 1) -> np.ndarray:
    h = decoder.open_stream(seed)
    pieces: list[np.ndarray] = []
    for at in range(0, len(frames), burst):
        decoder.push(h, frames[at:at + burst])
        pieces += decoder.drain([h], as_float=True)
    decoder.finish(h)
    pieces += decoder.drain([h], as_float=True)
    decoder.close(h)
    return np.concatenate(pieces)


def noise_free_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same `snac.SNAC` weights built as `SNAC(noise=False)`: upstream's own decoder with its noise blocks off."""
    from snac import SNAC
    from snac.layers import NoiseBlock

    config = {name: getattr(model, name) for name in ("sampling_rate", "encoder_dim", "encoder_rates", "decoder_dim",
                                                      "decoder_rates", "attn_window_size", "codebook_size",
                                                      "codebook_dim", "vq_strides")}
    quiet = SNAC(**config, latent_dim=model.latent_dim, noise=False)
    # Without its noise blocks each decoder block's layers are numbered one lower after them: the same weights, in
    # the same order, under other names.
    noise_blocks = [name for name, m in model.named_modules() if isinstance(m, NoiseBlock)]
    weights = [v for k, v in model.state_dict().items() if not any(k.startswith(b + ".") for b in noise_blocks)]
    names = list(quiet.state_dict())
    assert noise_blocks and len(weights) == len(names)
    quiet.load_state_dict(dict(zip(names, weights, strict=True)))
    return quiet.eval()


@pytest.mark.parametrize("n", [1, 7, 16])
def test_exact_against_plain_upstream_decode_with_noise_off(snac_model: torch.nn.Module, n: int) -> None:
    """No noise of ours anywhere: the streamed audio of a noise-free SNAC equals plain upstream `SNAC.decode` of the
    same codes (not only the position-tied reference)."""
    quiet = noise_free_copy(snac_model)
    frames = make_frames(n, seed=40 + n)
    layers = frames_to_layers(frames)
    with torch.inference_mode():
        plain = quiet.decode([torch.tensor([layer], dtype=torch.int64) for layer in layers])[0, 0].numpy()
    streamed = decode_alone(StreamingSnac(quiet, "cpu", "float32", max_streams=1), frames, seed=1, burst=2)
    assert streamed.shape == plain.shape == (n * SAMPLES_PER_FRAME,)
    assert np.abs(streamed - plain).max() < EXACT


# --- the receptive field -------------------------------------------------------------------------------------


def test_receptive_field_of_snac_is_the_decoders_delay(snac_model: torch.nn.Module, decoder: StreamingSnac) -> None:
    """Change one latent frame's code in the real SNAC decode: exactly the samples within the computed receptive
    field change (4757 before it: the right context a sample needs), none beyond."""
    frames = make_frames(12, seed=7)
    base = reference_decode(snac_model, [frames], [1])[0]
    changed_frames = [list(f) for f in frames]
    changed_frames[6][2] = (changed_frames[6][2] + 1234) % 4096  # layer 2, latent frame 24
    changed = reference_decode(snac_model, [[tuple(f) for f in changed_frames]], [1])[0]  # type: ignore[misc]
    moved = np.nonzero(changed != base)[0]
    latent = 24 * 512
    # The layer shapes give [512 j - 4757, 512 (j + 1) + 4757); the outermost contributions are ~1e-8 and may
    # round away, so the measured edges lie within a few samples inside (4757 / 4753 with the noise off).
    assert decoder.delay_samples == 4757
    assert decoder.delay_samples - 8 <= latent - moved.min() <= decoder.delay_samples
    assert decoder.delay_samples - 8 <= moved.max() + 1 - (latent + 512) <= decoder.delay_samples
    assert 2 * SAMPLES_PER_FRAME < decoder.delay_samples < 3 * SAMPLES_PER_FRAME  # 3 frames each side for windows


def test_windows_need_three_frames_of_context(snac_model: torch.nn.Module, utterances: dict[int, Utterance]) -> None:
    """The sensitivity check: 1/1 windows (the gateway's old decoder) and 2/2 are not exact, 3/3 windows are;
    the streamed decode is (test_exact_for_every_length)."""
    utt = utterances[9]
    target = slice(4 * SAMPLES_PER_FRAME, 5 * SAMPLES_PER_FRAME)  # frame 4
    errors = {}
    for context in (1, 2, 3):
        window = utt.frames[4 - context:5 + context]
        audio = reference_decode(snac_model, [window], [utt.seed], frame_offsets=[4 - context])[0]
        mine = audio[context * SAMPLES_PER_FRAME:(context + 1) * SAMPLES_PER_FRAME]
        errors[context] = float(np.abs(mine - utt.reference[target]).max())
    assert errors[1] > 1e-3, errors  # measured 2e-2 (38 dB SNR)
    assert errors[2] > 1e-5, errors  # small but not exact (measured 3e-4, 80 dB)
    assert errors[3] < EXACT, errors


# --- exactness -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", LENGTHS)
def test_exact_for_every_length(streamed: dict[int, Utterance], n: int) -> None:
    """Batched with other streams at other positions, frames in irregular bursts: the streamed audio is the full
    decode, first and last sample included."""
    utt = streamed[n]
    assert utt.streamed is not None
    assert utt.streamed.shape == utt.reference.shape == (n * SAMPLES_PER_FRAME,)
    assert np.abs(utt.streamed - utt.reference).max() < EXACT
    assert abs(utt.streamed[0] - utt.reference[0]) < EXACT and abs(utt.streamed[-1] - utt.reference[-1]) < EXACT


def test_decoded_frames_per_new_frame(streamed: dict[int, Utterance], decoder: StreamingSnac) -> None:
    """Each frame goes through the decoder once, plus ceil(4757 / 2048) = 3 flush steps per utterance."""
    long = streamed[40].handle
    assert long is not None
    assert long.stepped == 43
    assert long.decoded_per_new_frame <= 1.2  # 1.075; sliding 3-frame windows: ~2.9
    for n, utt in streamed.items():
        assert utt.handle is not None and utt.handle.stepped == n + 3


def test_batched_equals_alone(decoder: StreamingSnac, streamed: dict[int, Utterance]) -> None:
    for n in (5, 12):
        utt = streamed[n]
        alone = decode_alone(decoder, utt.frames, utt.seed)
        assert utt.streamed is not None
        assert np.abs(alone - utt.streamed).max() < 1e-6


def test_same_codes_same_audio(decoder: StreamingSnac, utterances: dict[int, Utterance]) -> None:
    """Reproducible (no torch.randn): twice, in other slots and other chunkings, gives the same audio; another
    seed gives other noise, and the noise matters."""
    utt = utterances[4]
    first = decode_alone(decoder, utt.frames, utt.seed, burst=1)
    busy = decoder.open_stream(1)  # the next stream gets another slot
    second = decode_alone(decoder, utt.frames, utt.seed, burst=3)
    decoder.close(busy)
    assert np.abs(first - second).max() < 1e-6
    other_seed = decode_alone(decoder, utt.frames, utt.seed + 1)
    assert np.abs(other_seed - first).max() > 1e-3


def test_masks_only_where_needed(decoder: StreamingSnac, utterances: dict[int, Utterance],
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Steady rows run without the edge masks (the `streamed` fixture mixes both kinds in every tick): masking
    every step gives the same audio, masking none does not (the masks are the zero padding at both ends)."""
    utt = utterances[6]
    mixed = decode_alone(decoder, utt.frames, utt.seed)
    monkeypatch.setattr(StreamingSnac, "needs_mask", lambda self, handle: True)
    always = decode_alone(decoder, utt.frames, utt.seed)
    monkeypatch.setattr(StreamingSnac, "needs_mask", lambda self, handle: False)
    never = decode_alone(decoder, utt.frames, utt.seed)
    assert np.abs(mixed - always).max() < 1e-6
    assert np.abs(never - utt.reference)[:SAMPLES_PER_FRAME].max() > 1e-2  # the start
    assert np.abs(never - utt.reference)[-SAMPLES_PER_FRAME:].max() > 1e-2  # the end


def decode_staggered(snac: StreamingSnac, chosen: list[Utterance], ticks: int,
                     lags: tuple[int, ...] = (0, 1, 3, 0)) -> None:
    """Four utterances fed one frame per tick from their own start tick (`lags`), one `step_batch` per tick for all
    (so batches shrink and grow, and streams sit at different positions): each done, and exact."""
    handles = [snac.open_stream(u.seed) for u in chosen]
    pieces: list[list[np.ndarray]] = [[] for _ in handles]
    for tick in range(ticks):
        for h, u, lag in zip(handles, chosen, lags, strict=True):
            if lag <= tick < lag + len(u.frames):
                snac.push(h, [u.frames[tick - lag]])
                if h.received == len(u.frames):
                    snac.finish(h)
        for out, piece in zip(pieces, snac.step_batch(handles, as_float=True), strict=True):
            out.append(piece)
    for u, h, out in zip(chosen, handles, pieces, strict=True):
        assert snac.done(h)
        assert np.abs(np.concatenate(out) - u.reference).max() < EXACT


def test_graph_buckets_emulated(snac_model: torch.nn.Module, utterances: dict[int, Utterance]) -> None:
    """The CUDA-graph path's host logic on CPU: static inputs, batches padded to a bucket with rows on the scratch
    slot, masked and unmasked graphs, batches split at the largest bucket. (The capture itself needs a GPU:
    tools/device/snac_stream_bench.py checks the captured graphs against `SNAC.decode`.)"""
    snac = StreamingSnac(snac_model, "cpu", "float32", max_streams=8)
    snac.capture_graphs(max_batch=3, buckets=(1,), emulate=True)
    assert sorted(snac._graphs) == [(False, 1), (False, 3), (True, 1), (True, 3)]
    decode_staggered(snac, [utterances[n] for n in (1, 3, 5, 2)], ticks=12)
    assert snac.stats.padded_rows > 0 and snac.stats.launches > 12  # padded buckets; 4 rows split as 3 + 1


def test_compiled_step_matches_eager(snac_model: torch.nn.Module, utterances: dict[int, Utterance]) -> None:
    """`compile=True`: the step through torch.compile with the depthwise convolutions as shifted products gives the
    full decode's audio (first and last frames included), in batches of 2 and 3 rows (a lone row is padded to 2),
    masked and unmasked, from two compiled graphs (`precompile` makes both before any step): the batch size does
    not recompile."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    snac = StreamingSnac(snac_model, "cpu", "float32", max_streams=8, compile=True)
    snac.precompile()  # as the gateway's loader does where no graph is captured: both graphs now, not in a tick
    assert counters["stats"]["unique_graphs"] == 2
    snac.capture_graphs(max_batch=3, buckets=(1,), emulate=True)
    assert sorted(snac._graphs) == [(False, 2), (False, 3), (True, 2), (True, 3)]
    chosen = [utterances[n] for n in (6, 3, 5, 2)]
    decode_staggered(snac, chosen, ticks=14)
    snac._graphs.clear()  # no graphs: a lone stream's row goes to the compiled step padded to two rows
    alone = decode_alone(snac, chosen[0].frames, chosen[0].seed)
    assert np.abs(alone - chosen[0].reference).max() < EXACT
    assert counters["stats"]["unique_graphs"] == 2  # masked and unmasked, whatever the batch size
    assert any(c.taps for c in snac.decoder.pre) and all(u.conv.taps for b in snac.decoder.blocks for u in b.units)


def decode_to_the_end(snac: StreamingSnac) -> None:
    """One short stream through the decoder to its last step (a decoder that loaded really runs)."""
    handle = snac.open_stream()
    snac.push(handle, make_frames(3, seed=5))
    snac.finish(handle)
    while not snac.done(handle):
        snac.step_batch([handle])


def test_a_default_compile_that_fails_falls_back_to_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """`StreamingSnac.load`: where compiling is only the default (as on a GPU) and the compiler fails (here: one
    that raises), the step runs eagerly with a warning; asked for by name (`--snac-compile`), the failure stops
    the start."""
    from gateway.devtools.devmodels import build_test_snac
    from gateway.speech.snac import pool

    path = str(build_test_snac(tmp_path))

    def no_compiler(fn: object, **options: object) -> object:
        def run(*args: object, **kwargs: object) -> None:
            raise RuntimeError("no compiler for this device")
        return run

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(pool, "snac_compiles", lambda device, compile: compile is not False)
    with caplog.at_level(logging.WARNING, logger=pool.__name__):
        snac = StreamingSnac.load(path, "cpu", "float32", max_streams=2, capture_graphs=False)
    assert not snac.compiled and "runs eagerly" in caplog.text
    decode_to_the_end(snac)
    with pytest.raises(RuntimeError, match="no compiler"):
        StreamingSnac.load(path, "cpu", "float32", max_streams=2, capture_graphs=False, compile=True)


def test_default_kernels_that_fail_fall_back_to_the_layers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """`StreamingSnac.load`: where the fused kernels are only the default (as on a GPU) and cannot run (here:
    Triton with no GPU driver), the step runs on the layers with a warning; asked for by name
    (`--snac-kernels`), the failure stops the start."""
    from gateway.devtools.devmodels import build_test_snac
    from gateway.speech.snac import pool

    path = str(build_test_snac(tmp_path))
    monkeypatch.setattr(pool, "snac_kernels", lambda device, kernels: kernels is not False)
    with caplog.at_level(logging.WARNING, logger=pool.__name__):
        snac = StreamingSnac.load(path, "cpu", "float32", max_streams=2, capture_graphs=False)
    assert not snac.kernels and "the fused kernels failed" in caplog.text
    decode_to_the_end(snac)
    with pytest.raises(RuntimeError):
        StreamingSnac.load(path, "cpu", "float32", max_streams=2, capture_graphs=False, kernels=True)


def test_bridge_graphs_emulated(snac_model: torch.nn.Module, decoder: StreamingSnac,
                                utterances: dict[int, Utterance]) -> None:
    """The bridge's graphs (host logic on CPU, as above): its common lengths replay a graph for batches up to the
    largest bucket, padded, and larger batches as several replays (a burst's first pieces); other lengths run
    eagerly; the audio is the eager decoder's."""
    snac = StreamingSnac(snac_model, "cpu", "float32", max_streams=8)
    snac.capture_graphs(max_batch=2, buckets=(1,), emulate=True)
    assert sorted(snac._bridge_graphs) == [(f, b) for f in (1, 2, 3) for b in (1, 2)]
    chosen = [utterances[n] for n in (17, 25, 40)]
    outputs = []
    for snac_, group in ((snac, chosen), (decoder, chosen)):
        handles = [snac_.open_stream(u.seed) for u in group]
        pieces: list[np.ndarray] = []
        for h, u in zip(handles, group, strict=True):
            snac_.push(h, u.frames[:2])
        pieces += snac_.bridge(handles[:2], as_float=True)  # 2 frames, batch 2: graph
        pieces += snac_.bridge(handles[2:], lookahead=1, as_float=True)  # 2 frames, batch 1: graph
        for h, u in zip(handles, group, strict=True):
            snac_.push(h, u.frames[2:3])
        pieces += snac_.bridge(handles, as_float=True)  # 3 frames, batch 3: graphs of 2 rows, then 1
        for h, u in zip(handles, group, strict=True):
            snac_.push(h, u.frames[3:6])
        pieces += snac_.bridge(handles, as_float=True)  # 5 frames: eager
        for h in handles:
            snac_.close(h)
        outputs.append(np.concatenate(pieces))
    assert snac.stats.bridge_launches == 5 and snac.stats.bridge_graphed == 4
    assert np.abs(outputs[0] - outputs[1]).max() < EXACT


def test_chunks_of_two_frames(snac_model: torch.nn.Module, utterances: dict[int, Utterance]) -> None:
    snac = StreamingSnac(snac_model, "cpu", "float32", max_streams=2, chunk_frames=2)
    for n in (1, 5):
        utt = utterances[n]
        audio = decode_alone(snac, utt.frames, utt.seed)
        assert np.abs(audio - utt.reference).max() < EXACT
    assert snac.stats.stepped_frames == 2 * (2 + 4)  # ceil((2048 n + 4757) / 4096) steps of 2 frames


def test_tensor_level_step(decoder: StreamingSnac, utterances: dict[int, Utterance]) -> None:
    """`step` on device tensors (what the graphs capture) with explicit slots, positions, ends and seeds."""
    utt = utterances[2]
    h = decoder.open_stream(utt.seed)
    frames = [*utt.frames, (0,) * 7, (0,) * 7, (0,) * 7]
    out = []
    for position, frame in enumerate(frames):
        audio, pcm = decoder.step(torch.tensor([h.slot]), torch.tensor([[frame]]), torch.tensor([position]),
                                  torch.tensor([2]), torch.tensor([utt.seed]))
        assert pcm.dtype == torch.int16
        start = position * SAMPLES_PER_FRAME - decoder.delay_samples
        out.append(audio[0, max(0, -start):].numpy())
    decoder.close(h)
    audio = np.concatenate(out)[:2 * SAMPLES_PER_FRAME]
    assert np.abs(audio - utt.reference).max() < EXACT
    assert OPEN_END > 1 << 32


# --- precision -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "bound"), [("bfloat16", BF16_MIN_SNR_DB), ("float16", FP16_MIN_SNR_DB)])
def test_half_precision_snr(snac_model: torch.nn.Module, utterances: dict[int, Utterance], dtype: str,
                            bound: float) -> None:
    """Half precision vs the float32 full decode. bfloat16 keeps 8 significant bits (a rounding of 2^-9 =
    -54 dB per operation); through ~30 layers that accumulates to the measured ~39 dB. The bound (33 dB)
    leaves 6 dB for other kernels (GPU) and catches real mistakes (noise positions or states at half
    precision, a lost mask): those cost tens of dB. float16 has 11 bits: measured ~58 dB, bound 50."""
    snac = StreamingSnac(snac_model, "cpu", dtype, max_streams=1)
    utt = utterances[7]
    audio = decode_alone(snac, utt.frames, utt.seed)
    assert audio.shape == utt.reference.shape
    assert snr_db(utt.reference, audio) > bound


def test_snac_runs_compiled_in_bfloat16_on_a_gpu_and_eager_float32_on_cpu_unless_told() -> None:
    """`--snac-dtype auto` (the default): bfloat16 where SNAC runs on CUDA (measured faster with more streams real
    time), float32 on CPU; a named dtype is kept. `--snac-device auto` is CUDA only when there is one. Likewise
    the step is compiled on CUDA unless `--snac-compile` says otherwise, and not on a CPU."""
    from gateway.config import from_sources

    assert from_sources(env={}).snac_dtype == "auto" and GPU_SNAC_DTYPE == "bfloat16"
    assert snac_device_and_dtype("cuda:1", "auto") == ("cuda:1", "bfloat16")
    assert snac_device_and_dtype("cpu", "auto") == ("cpu", "float32")
    assert snac_device_and_dtype("cuda", "float32") == ("cuda", "float32")
    assert snac_device_and_dtype("auto", "auto") == (("cuda", "bfloat16") if torch.cuda.is_available()
                                                     else ("cpu", "float32"))
    assert from_sources(env={}).snac_compile is None
    assert (snac_compiles("cuda:1", None), snac_compiles("cpu", None)) == (True, False)
    assert (snac_compiles("cuda", False), snac_compiles("cpu", True)) == (False, True)


# --- fast start: the bridge -----------------------------------------------------------------------------------


def run_with_bridge(decoder: StreamingSnac, utt: Utterance, start_lookahead: int, crossfade: int,
                    bridge_until: int | None = None) -> tuple[np.ndarray, StreamHandle, int, list[int]]:
    """Frames one by one, each followed by a step (as the stream decoder does). The bridge starts as soon as
    `1 + start_lookahead` frames are in and goes on (lookahead 1) while at most `bridge_until` frames are (default:
    only the first bridge). Returns the audio, the handle, the frames received when the first exact audio came
    out, and where each bridge piece began (its seam)."""
    h = decoder.open_stream(utt.seed)
    pieces: list[np.ndarray] = []
    seams: list[int] = []
    first_exact = -1
    until = 1 + start_lookahead if bridge_until is None else bridge_until
    for frame in utt.frames:
        decoder.push(h, [frame])
        if 1 + start_lookahead <= h.received <= until:
            at = h.emitted
            (chunk,) = decoder.bridge([h], lookahead=start_lookahead if h.emitted == 0 else 1,
                                      crossfade=crossfade, as_float=True)
            if chunk.size:
                seams.append(at)
            pieces.append(chunk)
        piece = decoder.step_batch([h], as_float=True)[0]
        if piece.size and first_exact < 0:
            first_exact = h.received
        pieces.append(piece)
    decoder.finish(h)
    pieces += decoder.drain([h], as_float=True)
    decoder.close(h)
    return np.concatenate(pieces), h, first_exact, seams


def seam_figures(audio: np.ndarray, reference: np.ndarray, seams: list[int], crossfade: int) -> dict[str, float]:
    """Around each seam (a bridge piece's start, the exact stream's hand-over), the largest first difference of the
    audio and of its error, against the same figures away from the seams."""
    margin = 16
    near = np.zeros(len(audio) - 1, dtype=bool)
    for seam in seams:
        near[max(1, seam - margin):seam + crossfade + margin] = True
    step = np.abs(np.diff(audio))
    error_step = np.abs(np.diff(audio - reference))
    handover = seams[-1]
    return {
        "approx_snr_db": snr_db(reference[:handover], audio[:handover]),
        "fade_max_err": float(np.abs(audio - reference)[handover:handover + crossfade].max(initial=0.0)),
        "after_max_err": float(np.abs(audio - reference)[handover + crossfade:].max()),
        "seam_step": float(step[near].max()),
        "outside_step": float(step[~near].max()),
        "seam_error_step": float(error_step[near].max()),
        "approx_error_step": float(error_step[:handover][~near[:handover]].max()),
    }


def test_bridge_audio_outlives_the_next_bridge_decode(decoder: StreamingSnac,
                                                      utterances: dict[int, Utterance]) -> None:
    """A bridge decode's audio comes through a host buffer the next decode of its length reuses (pinned on a
    GPU): what it handed out must not change when the next one runs."""
    first, second = utterances[17], utterances[25]
    audio = decoder._bridge_decode([first.frames[:3]], [0], [first.seed])
    kept = audio.copy()
    decoder._bridge_decode([second.frames[:3]], [0], [second.seed])
    assert np.array_equal(audio, kept) and not np.array_equal(
        audio, decoder._bridge_decode([second.frames[:3]], [0], [second.seed]))


@pytest.mark.parametrize(("start_lookahead", "crossfade", "bridge_until", "handover", "first_exact"), [
    (1, 256, None, SAMPLES_PER_FRAME, 4),  # one frame once two are in
    (0, 256, None, SAMPLES_PER_FRAME - 256, 4),  # at once from one frame
    (1, 0, None, SAMPLES_PER_FRAME, 4),  # no crossfade
    (0, 512, 5, 4 * SAMPLES_PER_FRAME, 7),  # the bridge goes on to five frames (a stream short of lead)
])
def test_bridge_hands_over_to_the_exact_stream(decoder: StreamingSnac, utterances: dict[int, Utterance],
                                               start_lookahead: int, crossfade: int, bridge_until: int | None,
                                               handover: int, first_exact: int) -> None:
    """The fast start, then the exact stream: exact after the last crossfade, no step at any seam (the first
    difference there no larger than elsewhere; the error's first difference no larger than twice the
    approximation's own). Exact audio past the hand-over needs 4757 samples more input: two frames after the
    bridge's last one, e.g. the fourth frame after a one-frame bridge."""
    utt = utterances[10]
    audio, h, exact_at, seams = run_with_bridge(decoder, utt, start_lookahead, crossfade, bridge_until)
    assert audio.shape == utt.reference.shape
    assert h.handover == handover and exact_at == first_exact
    figures = seam_figures(audio, utt.reference, [*seams[1:], h.handover], crossfade)
    assert figures["after_max_err"] < EXACT
    assert figures["approx_snr_db"] > (15 if start_lookahead == 0 else 30)  # measured 22.8 / 38.6 dB
    assert figures["seam_step"] <= 1.25 * figures["outside_step"]
    assert figures["seam_error_step"] <= 2 * figures["approx_error_step"]
    # The error-step criterion is sensitive: a step of 5x the approximation's own roughness at the seam (0.08
    # with two frames in, 0.5 from one frame; the signal's own first differences reach 0.85) breaks it.
    stepped = audio.copy()
    stepped[h.handover:] += 5 * figures["approx_error_step"]
    broken = seam_figures(stepped, utt.reference, [h.handover], crossfade)
    assert broken["seam_error_step"] > 2 * broken["approx_error_step"]


def test_bridge_pieces_are_windows_and_end_at_the_head(decoder: StreamingSnac,
                                                       utterances: dict[int, Utterance]) -> None:
    """Each bridge decode covers its new frames and one frame of left context (not the whole prefix); a call
    without new frames adds nothing; the bridge stops at MAX_HEAD_FRAMES frames, and once the exact stream has
    handed out audio past the bridge's, the bridge is over."""
    utt = utterances[17]
    h = decoder.open_stream(utt.seed)
    before = decoder.stats.approx_frames
    decoder.push(h, utt.frames[:2])
    assert decoder.bridge([h])[0].size == SAMPLES_PER_FRAME and decoder.stats.approx_frames - before == 2
    assert decoder.bridge([h])[0].size == 0  # nothing new
    decoder.push(h, utt.frames[2:3])
    assert decoder.bridge([h])[0].size == SAMPLES_PER_FRAME
    assert decoder.stats.approx_frames - before == 2 + 3  # frames 0..2: one frame of context before frame 1
    decoder.push(h, utt.frames[3:12])
    assert decoder.bridge([h])[0].size == (MAX_HEAD_FRAMES - 3) * SAMPLES_PER_FRAME
    assert h.bridged == MAX_HEAD_FRAMES and decoder.bridging_over(h)
    assert decoder.bridge([h])[0].size == 0
    decoder.drain([h])
    assert h.emitted > h.handover and decoder.bridging_over(h)
    decoder.close(h)
    with pytest.raises(ValueError, match="lookahead"):
        decoder.bridge([h], lookahead=MAX_HEAD_FRAMES)


def test_int16_output_with_bridge(decoder: StreamingSnac, utterances: dict[int, Utterance]) -> None:
    """The default int16 PCM (bridge, crossfade, exact stream) is the float audio scaled and truncated."""
    utt = utterances[3]
    outputs = {}
    for as_float in (True, False):
        h = decoder.open_stream(utt.seed)
        decoder.push(h, utt.frames[:2])
        pieces = decoder.bridge([h], as_float=as_float)
        decoder.push(h, utt.frames[2:])
        decoder.finish(h)
        pieces += decoder.drain([h], as_float=as_float)
        decoder.close(h)
        outputs[as_float] = np.concatenate(pieces)
    assert outputs[False].dtype == np.int16 and outputs[False].shape == utt.reference.shape
    expected = (np.clip(outputs[True], -1, 1) * 32767).astype(np.int32)
    assert np.abs(outputs[False].astype(np.int32) - expected).max() <= 1


@pytest.mark.parametrize("bridged_first", [False, True])
def test_bridge_to_the_end_of_a_short_utterance_is_exact(decoder: StreamingSnac, utterances: dict[int, Utterance],
                                                         bridged_first: bool) -> None:
    """A finished utterance within the head: the bridge decodes it whole from frame 0, exact, and the stream is
    done (after an earlier bridge piece too: exact from the end of its crossfade)."""
    utt = utterances[5]
    h = decoder.open_stream(utt.seed)
    pieces = []
    if bridged_first:
        decoder.push(h, utt.frames[:2])
        pieces += decoder.bridge([h], as_float=True)
        decoder.push(h, utt.frames[2:])
    else:
        decoder.push(h, utt.frames)
    decoder.finish(h)
    pieces += decoder.bridge([h], as_float=True)
    assert decoder.done(h) and not decoder.ready(h)
    decoder.close(h)
    audio = np.concatenate(pieces)
    assert audio.shape == utt.reference.shape
    exact_from = SAMPLES_PER_FRAME + 512 if bridged_first else 0
    assert np.abs(audio - utt.reference)[exact_from:].max() < EXACT


@pytest.fixture
def stream_decoder(snac_model: torch.nn.Module) -> Iterator[StreamDecoder]:
    """A stream decoder (its worker thread) over a 2-stream float32 SNAC on the CPU, closed after the test."""
    decoder = StreamDecoder(StreamingSnac(snac_model, "cpu", "float32", max_streams=2))
    yield decoder
    decoder.close()


def decoder_on(clock: ManualClock, snac_model: torch.nn.Module, max_streams: int = 2,
               **options: Any) -> StreamDecoder:
    """A stream decoder (its worker thread) over a float32 SNAC on the CPU whose time is `clock`: it stands still
    until the test moves it, so a timing rule is tested on the times the test sets."""
    return StreamDecoder(StreamingSnac(snac_model, "cpu", "float32", max_streams=max_streams), clock=clock, **options)


def worker_ticks(decoder: StreamDecoder) -> int:
    return sum(decoder.stats.tick_ms)


async def worker_looked(decoder: StreamDecoder) -> None:
    """Until the decoder's worker has begun and ended a tick since now, on its clock as the test left it: whatever it
    would do at that time, it has done (the tick under way may have read the clock before; the next cannot). Its
    waits last the clock's seconds of real time, so this comes within them."""
    ticks = worker_ticks(decoder)
    await wait_until(lambda: worker_ticks(decoder) > ticks + 1, timeout=30, message="the decoder's worker ticked")


async def test_a_stream_with_lead_to_spare_waits_for_the_held_step_and_a_due_one_does_not(
        snac_model: torch.nn.Module) -> None:
    """Deadline scheduling, on the decoder's clock: a stream whose listener is far ahead (1 s) is stepped only once
    the hold since the last step has run out (0.3 s here), not 10 ms sooner, so it would share that step with
    others; one about to run dry (lead 0) is stepped as soon as its frame comes, the clock standing still."""
    hold_s = 0.3
    clock = ManualClock()
    decoder = decoder_on(clock, snac_model, hold_s=hold_s)
    try:
        lead = [1.0]
        stream = decoder.open(lambda: lead[0], lookahead=0)
        frames = make_frames(8, seed=21)
        decoder.push(stream, frames[:2])
        await asyncio.wait_for(stream.chunks.get(), 60)  # first audio: the bridge, at once
        decoder.push(stream, frames[2:4])
        await wait_until(lambda: not stream.bridging)  # 1 s covers the hand-over: the exact stream takes over
        handle = stream.handle
        assert handle is not None
        lead[0] = 0.0  # due: every frame is stepped as it comes, no time passing
        decoder.push(stream, frames[4:5])
        await wait_until(lambda: handle.received == 5 and not decoder.snac.ready(handle), timeout=30)
        held, stepped = decoder.stats.held_steps, handle.stepped
        clock.advance(0.05)

        lead[0] = 1.0  # lead to spare: the frame waits for the hold, counted from the step just taken
        decoder.push(stream, frames[5:6])
        await wait_until(lambda: handle.received == 6, timeout=30)
        clock.advance(hold_s - 0.05 - 0.01)
        await worker_looked(decoder)
        assert handle.stepped == stepped, "stepped before the hold ran out"
        clock.advance(0.02)
        await wait_until(lambda: handle.stepped > stepped, timeout=30)
        assert decoder.stats.held_steps == held + 1
    finally:
        decoder.close()


async def test_after_a_step_the_next_waits_for_its_rest_though_a_stream_is_due(snac_model: torch.nn.Module) -> None:
    """`step_duty`, on the decoder's clock: each step takes 30 ms of it here. At a duty of 1/4 a step that left an
    open stream out (it had no frame) is followed by none until 120 ms from its start, though the stepped stream's
    lead is 0 (due); the next comes once that rest is over. A step that took both streams rests only its own 30 ms:
    waiting could not have grown it. At a duty of 1 due frames are stepped as they come, the clock standing still."""
    step_s, duty = 0.03, 0.25
    clock = ManualClock()
    decoder = decoder_on(clock, snac_model)
    step_batch, step_starts = decoder.snac.step_batch, []

    def timed_step(handles: list[Any]) -> list[np.ndarray]:
        step_starts.append(clock())
        clock.advance(step_s)
        return step_batch(handles)

    decoder.snac.step_batch = timed_step  # type: ignore[method-assign]
    try:
        lead = [1.0]  # both listeners'
        streams, frames = [], [make_frames(10, seed=22 + k) for k in range(2)]
        for k in range(2):
            stream = decoder.open(lambda: lead[0], lookahead=0)
            decoder.push(stream, frames[k][:2])
            await asyncio.wait_for(stream.chunks.get(), 60)
            decoder.push(stream, frames[k][2:4])
            await wait_until(lambda stream=stream: not stream.bridging)
            streams.append(stream)
        a, b = (stream.handle for stream in streams)
        assert a is not None and b is not None
        lead[0] = 0.0  # due from now on; at duty 1 the frames in are stepped one after another at once
        decoder.push(streams[0], frames[0][4:5])
        await wait_until(lambda: not decoder.snac.ready(a) and not decoder.snac.ready(b), timeout=30)
        assert a.stepped == 5 and b.stepped == 4

        decoder.timing.step_duty = duty
        decoder.push(streams[0], frames[0][5:6])  # stepped at once (the last step left no rest), b left out
        await wait_until(lambda: a.stepped == 6, timeout=30)
        rested_at = step_starts[-1] + step_s / duty
        decoder.push(streams[0], frames[0][6:7])
        await wait_until(lambda: a.received == 7, timeout=30)
        clock.advance(rested_at - clock() - 0.01)
        await worker_looked(decoder)
        assert a.stepped == 6, "stepped before the last step's rest was over"
        clock.advance(0.02)
        await wait_until(lambda: a.stepped == 7, timeout=30)
        assert rested_at <= step_starts[-1] <= rested_at + 0.01

        clock.advance(step_s / duty)  # past that step's rest: the next step takes both, and rests only itself
        decoder.push(streams[0], frames[0][7:8])
        decoder.push(streams[1], frames[1][4:5])
        await wait_until(lambda: a.stepped == 8 and b.stepped == 5, timeout=30)
        decoder.push(streams[0], frames[0][8:9])
        await wait_until(lambda: a.stepped == 9, timeout=30)
        assert step_starts[-1] - step_starts[-2] == pytest.approx(step_s)
    finally:
        decoder.close()


def test_a_step_duty_outside_its_range_is_refused(snac_model: torch.nn.Module) -> None:
    """By the decoder (direct users: the benchmarks) and by the gateway's configuration (one line at start-up)."""
    import argparse

    from gateway.config import ConfigError, add_arguments, from_sources

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for duty in (0.0, 1.5):
        with pytest.raises(ValueError, match="step_duty"):
            decoder_on(ManualClock(), snac_model, step_duty=duty)
        with pytest.raises(ConfigError, match="snac_step_duty"):
            from_sources(parser.parse_args(["--snac-step-duty", str(duty)]), env={})
    assert from_sources(parser.parse_args(["--snac-step-duty", "0.25"]), env={}).snac_step_duty == 0.25


@pytest.mark.parametrize(("lead_s", "handover"), [(0.0, (MAX_HEAD_FRAMES - 1) * SAMPLES_PER_FRAME),
                                                  (1.0, SAMPLES_PER_FRAME)])
async def test_the_bridge_goes_on_until_the_lead_covers_the_handover(stream_decoder: StreamDecoder, lead_s: float,
                                                                    handover: int) -> None:
    """The stream decoder's policy: a stream without lead (a listener who plays what comes, generation at real-time
    pace) gets bridge audio up to the head's end before the exact stream takes over; one whose lead covers the
    hand-over (1 s > 4757 samples) hands over after its first audio. Every sample comes out once either way."""
    frames = make_frames(12, seed=12)
    stream = stream_decoder.open(lambda: lead_s, lookahead=1)
    stream_decoder.push(stream, frames[:2])
    first = await asyncio.wait_for(stream.chunks.get(), 60)
    assert isinstance(first, tuple) and first[0].shape == (SAMPLES_PER_FRAME,)
    for frame in frames[2:]:
        stream_decoder.push(stream, [frame])
    stream_decoder.finish(stream)
    rest = await decoded_audio(stream.chunks)
    assert stream.handle is not None and stream.handle.handover == handover
    assert len(first[0]) + len(rest) == len(frames) * SAMPLES_PER_FRAME


@pytest.mark.parametrize(("lead_per_frame_s", "handover_frames"), [(0.0, 2), (0.02, MAX_HEAD_FRAMES - 1)])
async def test_the_bridge_stops_early_when_the_lead_will_not_cover_the_handover(
        stream_decoder: StreamDecoder, lead_per_frame_s: float, handover_frames: int) -> None:
    """Frames one at a time. A lead that does not grow (generation at real-time pace) will never cover the
    hand-over: the bridge stops at its second check instead of decoding on to the head's end. A lead that grows
    20 ms a frame (generation at ~1.3x) needs 198 - 3 x 20 ms by the head's end and gets there: it bridges on."""
    frames = make_frames(12, seed=13)
    holder: list[DecodeStream] = []

    def lead_s() -> float:
        handle = holder[0].handle if holder else None
        return lead_per_frame_s * (handle.bridged if handle is not None else 0)

    stream = stream_decoder.open(lead_s, lookahead=1)
    holder.append(stream)
    for k in range(2, len(frames) + 1):
        stream_decoder.push(stream, frames[k - 1:k] if k > 2 else frames[:2])
        await wait_until(lambda k=k: stream.handle is not None and (
            not stream.bridging or stream.handle.bridged >= min(k, MAX_HEAD_FRAMES)), timeout=60)
    stream_decoder.finish(stream)
    audio = await decoded_audio(stream.chunks)
    assert stream.handle is not None and stream.handle.handover == handover_frames * SAMPLES_PER_FRAME
    assert len(audio) == len(frames) * SAMPLES_PER_FRAME


@pytest.mark.parametrize(("lead_s", "second_piece"), [(0.0, SAMPLES_PER_FRAME), (0.1, BRIDGE_CROSSFADE)])
async def test_a_fast_start_without_lead_goes_on_without_lookahead(stream_decoder: StreamDecoder, lead_s: float,
                                                                  second_piece: int) -> None:
    """After a lookahead-0 start, a listener with less than a frame ahead (0 ms) gets the next frame whole as soon
    as it is in (lookahead 0 again), not just the crossfade a lookahead-1 piece adds until a frame beyond it
    arrives; with more than a frame ahead (100 ms) the pieces go back to lookahead 1."""
    frames = make_frames(4, seed=14)
    stream = stream_decoder.open(lambda: lead_s, lookahead=0)
    stream_decoder.push(stream, frames[:1])
    first = await asyncio.wait_for(stream.chunks.get(), 60)
    assert isinstance(first, tuple) and first[0].shape == (SAMPLES_PER_FRAME - BRIDGE_CROSSFADE,)
    stream_decoder.push(stream, frames[1:2])
    second = await asyncio.wait_for(stream.chunks.get(), 60)
    assert isinstance(second, tuple) and second[0].shape == (second_piece,)
    stream_decoder.push(stream, frames[2:])
    stream_decoder.finish(stream)
    rest = await decoded_audio(stream.chunks)
    assert len(first[0]) + len(second[0]) + len(rest) == len(frames) * SAMPLES_PER_FRAME


def test_the_first_audio_waits_for_what_the_hand_over_will_cost_at_the_pace_shown(
        stream_decoder: StreamDecoder) -> None:
    """`start_hold_s`: at real-time pace the bridge gains no lead, so a listener without a buffer starts the
    hand-over's whole cost later; at 1.2x the bridge's 8 frames gain part of it; at 1.5x all of it (no wait); a
    listener whose buffer covers the hand-over never waits; and a later frame at the same pace moves the start
    by nothing (the wait counts from the latest frame, which came one interval later)."""
    handover = stream_decoder.handover_lead_s
    head = stream_decoder.snac.HEAD_FRAMES

    def hold(pace: float, received: int = 2, lead_s: float = 0.0) -> float:
        return start_hold_s(received, FRAME_S / pace, lead_s, handover, head)

    assert hold(1.0) == pytest.approx(handover)
    assert 0.05 < hold(1.2) < 0.1 < handover
    assert hold(1.5) <= 0.0
    assert hold(1.0, lead_s=0.5) <= 0.0
    assert hold(1.2, received=3) == pytest.approx(hold(1.2) - FRAME_S / 1.2)


async def test_a_listener_without_a_buffer_starts_after_the_wait_and_a_buffered_one_at_once(
        snac_model: torch.nn.Module) -> None:
    """Bridged starts only (`bridge-held`), on the decoder's clock. Two streams get their first two frames one
    frame's time apart (real-time pace): the one whose listener buffers 1 s gets its first audio at once, the clock
    standing still; the one whose listener plays what comes (0 ms) not before the hand-over's cost has passed after
    its head was in (`start_hold_s`: at real-time pace the whole cost), and once it has. Both come out whole."""
    starts: list[tuple[bool, float, float | None]] = []  # the metrics hook's reports
    clock = ManualClock()
    decoder = decoder_on(clock, snac_model, start=BRIDGE_HELD, on_first_audio=lambda *start: starts.append(start))
    try:
        frames = make_frames(4, seed=15)
        leads = [0.0, 1.0]
        held, buffered = (decoder.open(lambda k=k: leads[k], lookahead=1) for k in range(2))
        for stream in (held, buffered):
            decoder.push(stream, frames[:1])
        head_in = clock.advance(FRAME_S)
        for stream in (held, buffered):
            decoder.push(stream, frames[1:2])
        first = await asyncio.wait_for(buffered.chunks.get(), 60)
        assert isinstance(first, tuple) and len(first[0]) > 0  # at once: the clock has not moved
        wait = start_hold_s(2, FRAME_S, 0.0, decoder.handover_lead_s, decoder.snac.HEAD_FRAMES)
        assert wait == pytest.approx(decoder.handover_lead_s) and wait < MAX_START_HOLD_S
        assert held.start_at == pytest.approx(head_in + wait)
        clock.advance(wait - 0.01)
        await worker_looked(decoder)
        assert not held.started and held.chunks.empty(), "the held one started before its wait was over"
        released = clock.advance(0.02)
        first = await asyncio.wait_for(held.chunks.get(), 60)
        assert isinstance(first, tuple) and len(first[0]) > 0
        leads[1] = 0.0  # the buffer played out: the rest is stepped as it comes, the clock standing still
        for stream in (held, buffered):
            decoder.push(stream, frames[2:])
            decoder.finish(stream)
        for stream in (held, buffered):
            rest = await decoded_audio(stream.chunks)
            assert stream.handle is not None
            assert stream.handle.emitted == len(frames) * SAMPLES_PER_FRAME > len(rest)
    finally:
        decoder.close()
    # Both from the bridge, both planned at the pace their frames showed; the buffered one held for nothing, the
    # other until the clock was moved past its wait (head in to audio out). The totals are the reports' sums.
    held_for = pytest.approx(released - head_in)
    assert starts == [(False, 0.0, pytest.approx(FRAME_S)), (False, held_for, pytest.approx(FRAME_S))]
    stats = decoder.stats
    assert stats.first_audios == stats.paced_starts == 2 and stats.exact_starts == 0
    assert stats.start_hold_s == held_for and stats.start_pace_s == pytest.approx(2 * FRAME_S)


def test_a_slow_pace_starts_from_the_exact_stream_and_a_fast_one_from_the_bridge(
        stream_decoder: StreamDecoder) -> None:
    """`exact_start_hold_s`: without a bridge there is no hand-over to build lead for, so at real-time pace the
    exact stream starts sooner than the held bridge (a frame's time less its margin: 173 against 218 ms); at 1.2x
    it starts later, within `EXACT_START_PREFERENCE_S` (its margin aside), so it is still chosen; at 2x the bridge
    needs no wait, even at the pace its work leaves, and the exact stream's third frame comes too late to be chosen.
    A buffer that covers the delay needs no wait either."""
    handover = stream_decoder.handover_lead_s
    head = stream_decoder.snac.HEAD_FRAMES

    def exact(pace: float, received: int = 2, lead_s: float = 0.0) -> float:
        return exact_start_hold_s(received, FRAME_S / pace, lead_s, handover, head)

    def bridged(pace: float) -> float:
        return max(0.0, start_hold_s(2, FRAME_S / pace, 0.0, handover, head))

    assert exact(1.0) == pytest.approx(handover - FRAME_S + EXACT_START_MARGIN_S)
    assert exact(1.0) < bridged(1.0) - 0.04
    assert bridged(1.2) < exact(1.2) <= bridged(1.2) + EXACT_START_PREFERENCE_S + EXACT_START_MARGIN_S
    assert starts_exact(2, FRAME_S / 1.2, 0.0, handover, head) and starts_exact(2, FRAME_S, 0.0, handover, head)
    assert bridged(2.0) == 0.0 and not starts_exact(2, FRAME_S / 2.0, 0.0, handover, head)
    assert exact(1.0, lead_s=0.5) <= 0.0
    assert exact(0.8) > exact(1.0)  # slower than real time: the head's end is the worst point


def test_a_bridged_start_is_planned_at_the_pace_its_bridges_leave(stream_decoder: StreamDecoder) -> None:
    """`BRIDGE_PACE_FACTOR`: a burst's bridges slow generation after the head (H200, 256 users: a first interval of
    60 ms, then 83), so the bridge is weighed at 1.4x the measured interval. At 60 ms (1.4x real time) the held
    bridge alone would start at once, and its listeners paused; weighed at 84 ms it must wait, and the exact stream
    is chosen. At 40 ms (H200, 128 users; 2.1x) the bridge still needs no wait at the slower pace and starts at once.
    The hold of a bridged start is the factored one."""
    handover = stream_decoder.handover_lead_s
    head = stream_decoder.snac.HEAD_FRAMES
    assert start_hold_s(2, 0.060, 0.0, handover, head) <= 0.0
    factored = start_hold_s(2, 0.060 * BRIDGE_PACE_FACTOR, 0.0, handover, head)
    assert factored > 0.0 and bridged_start_hold_s(2, 0.060, 0.0, handover, head) == pytest.approx(factored)
    assert starts_exact(2, 0.060, 0.0, handover, head)
    assert bridged_start_hold_s(2, 0.040, 0.0, handover, head) <= 0.0
    assert not starts_exact(2, 0.040, 0.0, handover, head)


def test_the_generation_pace_is_the_median_frame_interval_of_its_window() -> None:
    """`GenerationPace`: the median of the window's per-frame intervals (an outlier does not move it; a push of
    two frames counts its interval per frame), and nothing once the window has passed them all."""
    pace = GenerationPace(window_s=0.5)
    assert pace.seconds_per_frame(10.0) == 0.0
    for k, seconds in enumerate([0.08, 0.09, 0.5, 0.085]):
        pace.add(10.0 + 0.01 * k, seconds, frames=1)
    pace.add(10.05, 0.17, frames=2)
    assert pace.seconds_per_frame(10.1) == pytest.approx(0.085)
    pace.add(10.4, 0.07, frames=1)
    assert pace.seconds_per_frame(10.52) == pytest.approx(0.085)  # the first left the window: 0.09 .. 0.5
    assert pace.seconds_per_frame(10.85) == pytest.approx(0.07)
    assert pace.seconds_per_frame(11.0) == 0.0


async def test_a_real_time_paced_stream_starts_from_the_exact_stream_held_and_exact(
        snac_model: torch.nn.Module) -> None:
    """Frames at real-time pace on the decoder's clock, one at a time, to a listener without a buffer: the exact
    start is chosen at the head, planned at that pace, and held `exact_start_hold_s` after the head's second frame;
    its third frame (all the exact stream's first audio needs) comes 2 ms before that, and no audio goes out until
    the clock has passed it. Then no bridge decode at all: the first audio is the exact stream's first (3 frames less
    its delay), and every sample is the full decode's (no crossfade anywhere)."""
    frames = make_frames(6, seed=31)
    clock = ManualClock()
    decoder = decoder_on(clock, snac_model)
    try:
        stream = decoder.open(lambda: 0.0, lookahead=1)
        bridged = decoder.snac.stats.approx_frames
        decoder.push(stream, frames[:1])
        head_in = clock.advance(FRAME_S)
        decoder.push(stream, frames[1:2])
        await wait_until(lambda: stream.exact_start is not None, timeout=30)
        wait = exact_start_hold_s(2, FRAME_S, 0.0, decoder.handover_lead_s, decoder.snac.HEAD_FRAMES)
        assert stream.exact_start and stream.start_pace_s == pytest.approx(FRAME_S)
        assert stream.start_at == pytest.approx(head_in + wait)
        for frame in frames[2:4]:
            clock.advance(FRAME_S)
            decoder.push(stream, [frame])
        assert clock() < stream.start_at
        handle = stream.handle
        assert handle is not None
        await wait_until(lambda: handle.received == 4 and handle.stepped == STEPS_BEFORE_AUDIO, timeout=30)
        await worker_looked(decoder)
        assert handle.stepped == STEPS_BEFORE_AUDIO and not stream.started, "audio out before its hold was over"
        released = clock.advance(FRAME_S)  # the next frame comes after the hold: the first audio goes out
        decoder.push(stream, frames[4:5])
        first = await asyncio.wait_for(stream.chunks.get(), 60)
        assert isinstance(first, tuple)
        assert len(first[0]) == 3 * SAMPLES_PER_FRAME - decoder.snac.delay_samples
        clock.advance(FRAME_S)
        decoder.push(stream, frames[5:])
        decoder.finish(stream)
        rest = await decoded_audio(stream.chunks)
    finally:
        decoder.close()
    # its first audio counted with its hold (head in to audio out, on the clock) and the pace it was planned at
    stats = decoder.stats
    assert stats.exact_starts == stats.first_audios == 1
    assert stats.start_hold_s == pytest.approx(released - head_in) and stats.start_pace_s == pytest.approx(FRAME_S)
    assert decoder.snac.stats.approx_frames == bridged
    reference = reference_decode(snac_model, [frames], [handle.seed])[0]
    audio = np.concatenate([first[0], rest]).astype(np.float32) / 32767
    assert audio.shape == reference.shape
    assert np.abs(audio - reference).max() < 2 / 32767  # int16 truncation only


async def test_a_streams_pace_is_the_slower_of_its_own_and_every_streams(snac_model: torch.nn.Module) -> None:
    """On the decoder's clock. A stream whose first two frames came 30 ms apart (2.8x: a bridge needs no wait, so it
    starts at once) starts that way alone, though the exact stream's third frame would come within
    `EXACT_START_PREFERENCE_S` of it: a bridge that need not wait is kept, it is first, and at such a pace its GPU
    time is to spare. Among streams whose frames come at real-time pace it reads their pace, which calls for the
    exact stream, held. (One stream's first interval is noisy; the engine steps all of them together.) Alone at
    60 ms (1.4x) it starts exact, planned at its own pace."""
    frames = make_frames(6, seed=32)

    async def decided(background: int, gap_s: float) -> tuple[bool, float | None]:
        """Whether the stream starts exact, and the pace it was planned at."""
        clock = ManualClock()
        decoder = decoder_on(clock, snac_model, max_streams=8)
        try:
            others = [decoder.open(lambda: 0.0, lookahead=1) for _ in range(background)]
            for k in range(4 if background else 0):
                clock.advance(FRAME_S)
                for other in others:
                    decoder.push(other, frames[k:k + 1])
            stream = decoder.open(lambda: 0.0, lookahead=1)
            decoder.push(stream, frames[:1])
            clock.advance(gap_s)
            decoder.push(stream, frames[1:2])
            await wait_until(lambda: stream.exact_start is not None, timeout=30)  # decided with its head
            for s in [*others, stream]:
                decoder.release(s)
            return bool(stream.exact_start), stream.start_pace_s
        finally:
            decoder.close()

    assert await decided(0, gap_s=0.03) == (False, pytest.approx(0.03))
    assert await decided(3, gap_s=0.03) == (True, pytest.approx(FRAME_S))
    assert await decided(0, gap_s=0.06) == (True, pytest.approx(0.06))


async def test_a_sentence_takes_a_decoder_slot_only_once_it_has_frames(stream_decoder: StreamDecoder) -> None:
    """Opening a stream sends nothing to the worker (its open goes with its first push): sentences that wait for
    their generation, or end without audio, hold no slot. With 2 slots, 3 opened streams of which 2 are released
    unused leave the third its slot, and it decodes whole."""
    waiting = [stream_decoder.open(lambda: 0.0) for _ in range(2)]
    stream = stream_decoder.open(lambda: 0.0)
    for unused in waiting:
        stream_decoder.release(unused)
    frames = make_frames(3, seed=16)
    stream_decoder.push(stream, frames)
    stream_decoder.finish(stream)
    audio = await decoded_audio(stream.chunks)
    assert len(audio) == len(frames) * SAMPLES_PER_FRAME


async def test_a_loop_iterations_commands_reach_the_worker_in_one_wake_up(stream_decoder: StreamDecoder) -> None:
    """Two sentences' opens, pushes and finishes made in one loop iteration wake the worker once (each wake-up takes
    the GIL from the event loop), in order: both decode whole. Sent one by one, the first would wake it while the
    iteration lets go of the GIL."""
    frames = make_frames(3, seed=17)
    streams = [stream_decoder.open(lambda: 0.0) for _ in range(2)]  # opening sends nothing
    before = stream_decoder.stats.wakeups
    for stream in streams:
        stream_decoder.push(stream, frames)
        time.sleep(0.005)  # noqa: ASYNC251 -- the GIL let go within the iteration, as the tokenizer does
        stream_decoder.finish(stream)
    for stream in streams:
        audio = await decoded_audio(stream.chunks)
        assert len(audio) == len(frames) * SAMPLES_PER_FRAME
    assert stream_decoder.stats.wakeups == before + 1


async def test_fast_tokens_get_audio_from_the_first_frame(stream_decoder: StreamDecoder) -> None:
    """Lookahead 0 (the engine's tokens come fast): the first audio is out once one frame is in, all of it but
    the crossfade that joins the next piece."""
    stream = stream_decoder.open(lambda: 0.0, lookahead=0)
    stream_decoder.push(stream, make_frames(1, seed=1))
    first = await asyncio.wait_for(stream.chunks.get(), 60)
    assert isinstance(first, tuple) and first[0].shape == (SAMPLES_PER_FRAME - BRIDGE_CROSSFADE,)
    stream_decoder.finish(stream)
    rest = await decoded_audio(stream.chunks)
    assert len(first[0]) + len(rest) == SAMPLES_PER_FRAME


# --- bookkeeping and noise ----------------------------------------------------------------------------------------


def test_slots_and_states(snac_model: torch.nn.Module) -> None:
    snac = StreamingSnac(snac_model, "cpu", "float32", max_streams=2)
    a, b = snac.open_stream(1), snac.open_stream(2)
    with pytest.raises(RuntimeError):
        snac.open_stream(3)
    assert not snac.ready(a)
    snac.push(a, make_frames(1, 0))
    assert snac.ready(a) and not snac.ready(b)
    snac.finish(b)
    assert snac.done(b) and not snac.ready(b)  # no frames: nothing to decode
    with pytest.raises(ValueError):
        snac.push(b, make_frames(1, 0))
    with pytest.raises(ValueError):
        snac.step_batch([a, a])
    with pytest.raises(ValueError):
        snac.push(a, [(0, 0, 0, 0, 0, 0, 4096)])
    snac.close(b)
    c = snac.open_stream(4)
    assert c.slot == b.slot
    assert snac.step_batch([a, b, c])[1].size == 0  # not ready: nothing, no error


def test_position_noise() -> None:
    seeds = torch.tensor([1, 2])
    pos = torch.arange(-500, 100_000)[None, :].repeat(2, 1)
    noise = position_noise(seeds, 0, pos)
    assert abs(float(noise.mean())) < 0.02 and abs(float(noise.std()) - 1) < 0.02
    assert float(torch.corrcoef(noise)[0, 1]) < 0.02  # seeds independent
    assert float(torch.corrcoef(torch.stack([noise[0, 1:], noise[0, :-1]]))[0, 1]) < 0.02  # white
    assert torch.equal(position_noise(seeds, 0, pos[:, 1000:1500]), noise[:, 1000:1500])  # a function of position
    assert not torch.equal(position_noise(seeds, 1, pos[:, :100]), noise[:, :100])  # layers differ


def test_a_sentence_starting_alone_takes_the_fast_start_at_a_slower_token_rate_than_one_in_a_burst() -> None:
    """An H100 at one stream (a token every 4 ms): the first frame's 7 tokens are in after 24 ms, and frames 2 and 3
    need 14 more, 56 ms. Alone the margin is 70 ms, so it starts fast; beside a burst (45 ms) it waits for its
    lookahead, as an H200 at 3.2 ms a token just does not (44.8 ms). 0 turns the fast start off either way."""
    needed = 3 * 7
    assert fast_start_margin_s(0.045, others_starting=0) == LONE_FAST_START_S == 0.07
    assert fast_start_margin_s(0.045, others_starting=63) == 0.045
    assert fast_start_margin_s(0.1, others_starting=0) == 0.1  # a larger configured margin is kept
    assert fast_start_margin_s(0.0, others_starting=0) == 0.0
    # While others wait for their first token, none: a burst's first tokens over vllm serve, 7 in 3 ms, pass any
    # margin, and the waiting prefills slow the next steps
    assert fast_start_margin_s(0.045, others_starting=0, others_waiting=1) == 0.0
    assert fast_start_in_time(7, 0.003, needed, 0.045)
    assert not fast_start_in_time(7, 0.003, needed, fast_start_margin_s(0.045, 63, others_waiting=31))
    assert fast_start_in_time(7, 0.024, needed, fast_start_margin_s(0.045, 0))
    assert not fast_start_in_time(7, 0.024, needed, fast_start_margin_s(0.045, 1))
    assert fast_start_in_time(7, 6 * 0.0032, needed, 0.045)
    assert not fast_start_in_time(7, 0.024, needed, 0.0)
    assert not fast_start_in_time(1, 0.0, needed, 1.0)  # one token says nothing about the rate



def test_the_step_duty_defaults_to_a_rest_on_cuda_and_none_on_a_cpu(tiny_snac_dir: Path) -> None:
    """`--snac-step-duty` unset: GPU_STEP_DUTY where SNAC shares a GPU with generation, 1 on a CPU (the gateway's
    tiny decoder loads on the CPU here); a value given is kept on either."""
    from gateway.speech.decoder import DecoderSettings, load_stream_decoder
    from gateway.speech.step_timing import GPU_STEP_DUTY, step_duty_on

    assert GPU_STEP_DUTY < 1
    assert step_duty_on("cuda", None) == GPU_STEP_DUTY and step_duty_on("cpu", None) == 1.0
    assert step_duty_on("cuda", 1.0) == 1.0 and step_duty_on("cpu", 0.5) == 0.5
    for given, expected in ((None, 1.0), (0.5, 0.5)):
        decoder = load_stream_decoder(DecoderSettings(snac_model=str(tiny_snac_dir), device="cpu", cuda_graphs=False,
                                                      max_batch=4, max_streams=8, step_duty=given))
        try:
            assert decoder.timing.step_duty == expected
        finally:
            decoder.close()
