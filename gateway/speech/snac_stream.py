"""Exact, incremental, batched streaming SNAC 24 kHz decoder.

Each stream feeds Orpheus frames (7 codes = 4 SNAC latent frames = 2048 samples) as they arrive. Every layer of
the decoder keeps its left context in a per-stream state (the last `(k-1)*dilation` inputs of each convolution,
the last input of each transposed convolution, the residual branch's skip input) and computes, per step, only
the samples that became computable. Each step advances a stream by exactly one chunk (`chunk_frames`, default
one Orpheus frame) at every layer, so each code frame runs through the decoder once, plus the flush steps at the
end of an utterance (`finish`). The output equals a full-sequence `SNAC.decode` of the same codes (with the
same position-tied noise) within float tolerance, first and last sample included: zero padding at the start
is the zeroed state plus masks, and the end applies the same right zero padding as the full decode.

Receptive field. From the layer shapes (conv k7 with dilations 1/3/9, transposed-conv kernels 2s, final k7),
latent frame j reaches samples [512 j - 4757, 512 (j + 1) + 4757). Measured with the `snac` package's own
decoder (random 24 kHz weights, noise off; change one layer-2 code, i.e. one latent frame, and see which
samples change): [512 j - 4757, 512 (j + 1) + 4753), nothing outside; the outermost contributions are ~1e-8
and the last few round away. So a sample needs 4757 samples of right context: 9.29 latent frames, 2.32 Orpheus
frames (the issue's "about +-10 latent frames, +-2.5 Orpheus frames" is the rounded-up figure), and as much
on the left. A window therefore needs 3 whole Orpheus frames of context on each side to be exact: 3/3 windows
match the full decode to float rounding (126 dB SNR), 2/2 windows differ by up to 3e-4 (80 dB) and 1/1 windows
(the gateway's decoder before this one) by up to 2e-2 (38 dB); the tests check all three.
`StreamingSnac.delay_samples` (4757) is computed from the layers: the exact stream's audio ends that many samples
before the end of the frames it has been fed.

Noise: SNAC's `NoiseBlock` draws `torch.randn` on every call, so no decode is reproducible. Here the noise
of block `layer` at sample `t` of a stream is a Gaussian made from a 32-bit integer hash of (stream seed, layer,
absolute position t) (Box-Muller on its two 16-bit halves), computed in torch on the device, inside the graph:
the same codes and seed give the same audio however the frames are chunked. `position_tied_noise` does the
same to a `snac.SNAC` model, so a reference full decode (`reference_decode`) is comparable sample by sample.

Batching: the states of all streams live in one preallocated pool tensor `[max_streams + 1, state_size]`
(119,232 values per stream; the last row is a scratch slot for padded batch rows). A step gathers the rows of
B streams (`index_select`), advances every stream by one chunk at its own position (per-row positions, ends
and seeds; masks computed on the device from them), scatters the rows back (`index_copy_`) and returns the
chunk's PCM. Shapes depend on B only, so on CUDA a graph per batch bucket (`GRAPH_BATCH_BUCKETS`) is captured
and replayed: one host-to-device copy of a packed input array, one replay, one device-to-host copy of the PCM;
no per-stream host sync. The edge masks (zero padding before the start and after the end) matter only in a
stream's first 3 steps and its flush steps; `step_batch` runs those rows through a masked graph and the others
through an unmasked one (the same numbers without 19 mask multiplications): at most two launches.

Chunk size: one Orpheus frame per stream per step. The LLM produces frames one at a time, and batching across
streams already gives the GPU large operations (B x 2048 samples per layer), so bigger per-stream chunks would
only add latency (a stream waits for k frames) and graphs per (batch, k). A stream with several new frames
joins consecutive `step_batch` calls (`drain` does that); its GPU work per frame is the same, only the number
of replays grows. `chunk_frames=k` is available for offline or throughput-bound use: fewer flush steps
(ceil(4757 / (2048 k))) and fewer replays. Work per utterance of N frames: N + 3 frame-steps (the 3 flush
steps), e.g. 1.075 decoded frames per new frame at N = 40, against ~2.9 for sliding 3-frame windows (the
benchmarks' baseline, tools/device/windows_baseline.py).

Latency and fast start: exact audio up to sample p needs the frames up to sample p + 4757, 2709 samples (113 ms
of audio, 1.32 frame times at generation pace) later than sliding windows with one frame of lookahead; the
first exact sample needs 3 frames, the first exact frame 4. `bridge` gives the fast start: a decode of the latest
frames (one frame of left context, zero padding after the last, as a sliding window) hands out audio up to
`lookahead` frames (0 or 1) before its end, continuing its last piece with a raised-cosine crossfade; the exact
stream takes over the same way once it is past the bridge's audio, and is exact from the end of that crossfade
on. Measured (random weights, CPU, `test_bridge_hands_over_to_the_exact_stream`): one bridge piece after 2
frames (lookahead 1, crossfade 256) 38.6 dB SNR against the full decode, error in the crossfade <= 0.011; after
1 frame (lookahead 0) 22.8 dB, error in the crossfade <= 0.10 (a 512-sample crossfade halves that); a bridge
that goes on to 5 frames (crossfade 512) 37.1 dB after a 1-frame start; after the hand-over the error is float
rounding (6e-7), and no seam shows a step larger than the signal's own. The cost of taking over: audio after the
bridge's last piece comes only once the exact stream passes it, two frames later, so the stream's lead must hold
4757 samples then (`StreamDecoder` bridges until it does); from then on every sample comes 1.32 frame times
later than with sliding windows. A bridge decodes 3 frames per bridged frame; its common lengths replay graphs.

Compilation (`compile=True`, `--snac-compile`): the step goes through `torch.compile` (one graph per `masked`
value, the batch size dynamic), written for Inductor to fuse (`_Decoder(fusable=True)`): the depthwise
convolutions as their 7 shifted products, so that each fuses with the Snake before it and the history's
concatenation, and the residual skips as one select per value instead of in-place adds into slices of the
branch. In both forms the new state is one `cat` of the pieces' tails (written into slices of one row,
Inductor made the ~40 slice writes one kernel over the whole row that evaluates every piece's index arithmetic
for every value: on an H200 2.85 of the compiled step's 9.1 ms at B=256), and a history is taken from the fresh
values where they are long enough (a concatenation used only by the taps is, on a GPU, recomputed in each of
the 7). The CUDA graphs then replay the compiled kernels. The GPU step is bound by its passes over activations
and the operations its kernels evaluate, not by peak arithmetic (on an H200, 15 TFLOP/s at B=256 in bfloat16,
and bfloat16 only 1.2x faster than float32). Counted on the CPU (`bench/snac_work.py`, float32, per stream and
new frame): eager, 373 kernels per step moving 77 MB; compiled, 38 MB and, lowered as for a GPU, 74 M
operations evaluated in 82 fused kernels (161 M in 41 before the two changes). Measured on an H200 before
them: 1.53x less GPU time than eager in bfloat16 (docs/benchmarks.md). Equal to the eager step within float
rounding (`test_compiled_step_matches_eager`).

Precision: float32, bfloat16 and float16 (weights, activations and states in that dtype; noise made in float32).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d, snake
from torch.nn import functional as nnf

from gateway.orpheus import CODEBOOK_SIZE, SAMPLES_PER_FRAME, SLOTS_PER_FRAME, Frame, frames_to_layers

log = logging.getLogger(__name__)

INT16_MAX = 32767
# Batch sizes with a captured graph: a batch runs in the smallest bucket that holds it (padded rows are wasted
# work, so above 64 the buckets grow by 64, not by doubling).
GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
# Bridge decodes with a captured graph: their common lengths (a first piece of 1 or 2 frames, a continuing piece of
# one new frame with its context and lookahead: 3) and batch sizes (the streams starting or bridging in one tick).
# Other lengths run eagerly: ~175 kernel launches each, about a millisecond of host time on a GPU.
BRIDGE_GRAPH_FRAMES = (1, 2, 3)
BRIDGE_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
OPEN_END = 1 << 40  # "end" (in frames) of a stream that has not finished
MAX_HEAD_FRAMES = 8  # frames of a stream's start kept for `bridge`: it covers at most the first 8 (0.68 s)
# Frames of left context of a bridge decode (before the first sample it hands out). Its error comes from the one
# frame of right context; 1 frame on the left costs 3 decoded frames per bridged frame, as sliding windows did.
BRIDGE_CONTEXT_FRAMES = 1
# A compiled step is general in the batch size from 2 up: dynamo specializes a dimension of size 1, so a lone row
# is padded to 2 (one scratch row) instead of compiling a third graph.
COMPILED_MIN_BATCH = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# SNAC's precision where `--snac-dtype auto` runs it on a GPU. Measured on one H200 in one lease
# (docs/benchmarks.md, 2026-12-04): the exact streaming decoder in bfloat16 kept 180 of 256 streams real time at
# 0 ms (float32: 74) and 110 of 384 at 500 ms (73), at 0.67 GPU ms per audio second at B=256 (0.80); 39 dB SNR
# against float32 (tests/test_snac_stream.py holds it above 33 dB). float16 is as fast and closer (56 dB), but
# not its range: snake's 1 / (alpha + 1e-9) overflows float16 for a trained alpha near 0, which random weights
# cannot show.
GPU_SNAC_DTYPE = "bfloat16"


def snac_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """The one reading of `--snac-device auto` (CUDA when there is one) and `--snac-dtype auto` (GPU_SNAC_DTYPE on
    CUDA; float32 elsewhere: CPUs without bfloat16 units run it slower, and CPU tests compare against float32)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = GPU_SNAC_DTYPE if device.startswith("cuda") else "float32"
    return device, dtype


def snac_compiles(device: str, compile: bool | None) -> bool:
    """The one reading of `--snac-compile`'s default (None): compile on CUDA, where Inductor's fused step ran a
    256-stream bfloat16 step 2.2x faster than eager on an H200 (6.0 against 13.4 ms, 2026-12-05); not on a CPU,
    where the compiled step was no faster (77.7 against 76.3 ms at 8 streams) and only adds its compile time."""
    return device.startswith("cuda") if compile is None else compile


# --- position-tied noise --------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
# Multipliers below 2**31: with values below 2**32 every product stays below 2**63 (no int64 overflow).
_MUL1 = 0x21F0AAAD
_MUL2 = 0x735A2D97


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, hash-prospector style) of int64 values, taken mod 2**32."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 15)


def position_noise(seeds: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """Standard normal noise [B, T] (float32) for `positions` [B, T] (absolute samples, int64) of the streams
    with `seeds` [B] (int64) in noise block `layer`: a pure function of (seed, layer, position).

    One 32-bit hash per sample (keyed by a hash of seed and layer, so streams and layers get unrelated
    sequences) gives two 16-bit uniforms for Box-Muller; the normal is cut at 4.7 sigma, which is irrelevant
    for SNAC's noise. About two dozen elementwise integer/float ops on [B, T]: small next to one pass over the
    [B, channels, T] activations."""
    key = _hash32(_hash32(seeds ^ (seeds >> 32)) + (layer + 1) * _GOLDEN)
    h = _hash32(positions + key[:, None])
    u1 = ((h >> 16) + 1).to(torch.float32) * (1.0 / 65536)  # (0, 1]
    u2 = (h & 0xFFFF).to(torch.float32) * (2.0 * math.pi / 65536)
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(u2)


LATENT_PER_FRAME = 4  # SNAC latent frames per Orpheus frame (vq_strides[0] * one layer-0 code per frame)


def _block_samples_per_frame(model: Any) -> list[int]:
    """Samples per Orpheus frame at the output of each decoder block (at each noise block)."""
    return [LATENT_PER_FRAME * r for r in itertools.accumulate(model.decoder_rates, lambda a, b: a * b)]


@contextlib.contextmanager
def position_tied_noise(model: torch.nn.Module, seeds: Sequence[int],
                        frame_offsets: Sequence[int] | None = None) -> Iterator[None]:
    """Within the block, the `snac.SNAC` `model`'s NoiseBlocks add `position_noise` instead of `torch.randn`:
    row b of a decode gets the noise of stream `seeds[b]` at absolute positions starting at Orpheus frame
    `frame_offsets[b]` (default 0), the noise `StreamingSnac` adds. For reference decodes (tests, checks)."""
    blocks = [m for m in model.modules() if isinstance(m, NoiseBlock)]
    per_frame = _block_samples_per_frame(model)
    offsets = list(frame_offsets) if frame_offsets is not None else [0] * len(seeds)

    def tied(block: Any, layer: int) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            length = x.shape[-1]
            seed_t = torch.tensor(list(seeds), dtype=torch.int64, device=x.device)
            first = torch.tensor(offsets, dtype=torch.int64, device=x.device) * per_frame[layer]
            pos = first[:, None] + torch.arange(length, device=x.device)[None, :]
            noise = position_noise(seed_t, layer, pos).to(x.dtype)[:, None, :]
            return x + noise * block.linear(x)

        return forward

    try:
        for layer, block in enumerate(blocks):
            block.forward = tied(block, layer)
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


def reference_decode(model: torch.nn.Module, frames: Sequence[Sequence[Frame]], seeds: Sequence[int],
                     frame_offsets: Sequence[int] | None = None) -> np.ndarray:
    """`snac.SNAC.decode` of equal-length rows of frames, all at once, with position-tied noise: float32 audio
    [rows, 2048 * frames] on the host. With offsets 0 (an utterance from its start) this is the exact result
    the streaming decoder must reproduce."""
    layers = [frames_to_layers(row) for row in frames]
    device = next(model.parameters()).device
    codes = [torch.tensor([row[i] for row in layers], dtype=torch.int64, device=device) for i in range(3)]
    with torch.inference_mode(), position_tied_noise(model, seeds, frame_offsets):
        audio = model.decode(codes)
    return audio[:, 0, :].float().cpu().numpy()


# --- decoder parameters -----------------------------------------------------------------------------------


@dataclass
class _Conv:
    """A (weight-normed, now fixed) Conv1d with symmetric zero padding `pad` in the full decode."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    dilation: int
    groups: int
    pad: int
    taps: bool = False  # depthwise only: `valid` as k shifted products (for torch.compile to fuse), not a conv

    @property
    def history(self) -> int:
        """Inputs a streaming step keeps from the previous step: (k - 1) * dilation."""
        return 2 * self.pad

    def full(self, x: torch.Tensor) -> torch.Tensor:
        return nnf.conv1d(x, self.weight, self.bias, padding=self.pad, dilation=self.dilation, groups=self.groups)

    def valid(self, x: torch.Tensor) -> torch.Tensor:
        if self.taps:
            # The same sum as the depthwise conv, written out: compiled, it becomes one elementwise kernel with
            # its neighbours (Snake, the history's concatenation) instead of PyTorch's generic depthwise kernel.
            length = x.shape[-1] - self.history
            out = x[..., :length] * self.weight[:, :, 0]
            for tap in range(1, self.weight.shape[-1]):
                at = tap * self.dilation
                out = out + x[..., at:at + length] * self.weight[:, :, tap]
            return out if self.bias is None else out + self.bias[:, None]
        return nnf.conv1d(x, self.weight, self.bias, dilation=self.dilation, groups=self.groups)


@dataclass
class _ConvT:
    """A ConvTranspose1d (stride s, kernel k, padding p): output t = full-convolution index t + p."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: int
    pad: int
    output_padding: int

    @property
    def history(self) -> int:
        """Earlier inputs that still reach the new outputs: ceil(k / s) - 1."""
        return -(-self.weight.shape[-1] // self.stride) - 1

    def full(self, x: torch.Tensor) -> torch.Tensor:
        return nnf.conv_transpose1d(x, self.weight, self.bias, stride=self.stride, padding=self.pad,
                                    output_padding=self.output_padding)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        """`x` = `history` kept inputs + C new ones at positions [a, a+C): the outputs of full-convolution
        indices [a*s, (a+C)*s), the ones no later input reaches."""
        h, s = self.history, self.stride
        new = x.shape[-1] - h
        return nnf.conv_transpose1d(x, self.weight, self.bias, stride=s)[..., h * s:(h + new) * s]


@dataclass
class _Snake:
    """snac's own TorchScript `snake` (x + sin(alpha x)^2 / alpha): the same numbers as the reference decode,
    and on CUDA TorchScript's fuser makes it one kernel, as in `SNAC.decode`."""

    alpha: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return snake(x, self.alpha)


@dataclass
class _Unit:
    """ResidualUnit: x + proj(snake2(conv(snake1(x)))), conv depthwise k7 dilated."""

    snake1: _Snake
    conv: _Conv
    snake2: _Snake
    proj: _Conv


@dataclass
class _Block:
    snake: _Snake
    up: _ConvT
    noise: _Conv | None
    units: list[_Unit]


def _tensor(t: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> Any:
    return None if t is None else t.detach().to(device=device, dtype=dtype).clone()


def _conv(m: Any, device: torch.device, dtype: torch.dtype, taps: bool = False) -> _Conv:
    k, d, pad = m.weight.shape[-1], m.dilation[0], m.padding[0]
    if (k - 1) * d != 2 * pad or m.stride[0] != 1:
        raise ValueError(f"unsupported convolution {m}: only stride 1 with symmetric 'same' padding")
    depthwise = m.groups > 1 and m.groups == m.in_channels == m.out_channels
    return _Conv(_tensor(m.weight, device, dtype), _tensor(m.bias, device, dtype), d, m.groups, pad,
                 taps=taps and depthwise)


def _snake(m: Any, device: torch.device, dtype: torch.dtype) -> _Snake:
    return _Snake(_tensor(m.alpha, device, dtype))


class _Decoder:
    """SNAC's decoder as plain tensors, run two ways: a full padded decode and a streaming step."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype, fusable: bool = False) -> None:
        """`fusable`: the streaming step written for torch.compile to fuse (depthwise convolutions as shifted
        products, residual skips as selects) rather than for eager kernels; the same numbers."""
        if getattr(model, "attn_window_size", None) is not None:
            raise ValueError("SNAC models with local attention (32/44 kHz) are not streamable here")
        if list(model.vq_strides) != [LATENT_PER_FRAME, 2, 1]:
            raise ValueError(f"expected vq_strides [4, 2, 1] (Orpheus' 24 kHz SNAC), got {model.vq_strides}")
        self.device, self.dtype, self.fusable = device, dtype, fusable
        with torch.no_grad():
            # Per codebook: out_proj(codebook) as a [4096, latent_dim] table; z = sum of three rows per latent frame.
            self.tables = [_tensor(q.out_proj(q.codebook.weight.t()[None])[0].t(), device, dtype)
                           for q in model.quantizer.quantizers]
            layers = list(model.decoder.model)
            self.pre: list[_Conv] = []
            self.blocks: list[_Block] = []
            rest: list[Any] = []
            for m in layers:
                if isinstance(m, DecoderBlock):
                    parts = list(m.block)
                    up = parts[1]
                    if up.weight.shape[-1] - 2 * up.padding[0] + up.output_padding[0] != up.stride[0]:
                        raise ValueError(f"unsupported transposed convolution {up}")
                    noise = next((p for p in parts if isinstance(p, NoiseBlock)), None)
                    units = [p for p in parts if isinstance(p, ResidualUnit)]
                    self.blocks.append(_Block(
                        _snake(parts[0], device, dtype),
                        _ConvT(_tensor(up.weight, device, dtype), _tensor(up.bias, device, dtype), up.stride[0],
                               up.padding[0], up.output_padding[0]),
                        None if noise is None else _conv(noise.linear, device, dtype),
                        [_Unit(*(_snake(u.block[0], device, dtype),
                                 _conv(u.block[1], device, dtype, fusable),
                                 _snake(u.block[2], device, dtype), _conv(u.block[3], device, dtype)))
                         for u in units]))
                elif not self.blocks:
                    if not isinstance(m, torch.nn.Conv1d):
                        raise ValueError(f"unsupported layer before the decoder blocks: {m}")
                    self.pre.append(_conv(m, device, dtype, fusable))
                else:
                    rest.append(m)
            if not (len(rest) == 3 and isinstance(rest[0], Snake1d) and isinstance(rest[2], torch.nn.Tanh)):
                raise ValueError(f"unexpected decoder tail {rest}")
            self.final_snake = _snake(rest[0], device, dtype)
            self.final = _conv(rest[1], device, dtype)
        probe = frames_to_layers([tuple(range(SLOTS_PER_FRAME))])  # type: ignore[list-item]
        # Frame columns feeding each latent frame j of the frame, per codebook (repeat_interleave by stride).
        self.columns = [torch.tensor([codes[j * len(codes) // LATENT_PER_FRAME] for j in range(LATENT_PER_FRAME)],
                                     device=device) for codes in probe]
        self.hop = math.prod(model.decoder_rates)
        if self.hop * LATENT_PER_FRAME != SAMPLES_PER_FRAME:
            raise ValueError(f"hop {self.hop} does not make {SAMPLES_PER_FRAME} samples per frame")
        self.state_shapes = self._state_shapes()
        self.state_size = sum(c * n for c, n in self.state_shapes)
        self.delay = self._delay()

    # -- layout ------------------------------------------------------------------------------------------

    def _state_shapes(self) -> list[tuple[int, int]]:
        """(channels, samples) of each piece of a stream's state, in the order `stream` reads them."""
        def inputs(c: _Conv) -> int:
            return c.weight.shape[1] * c.groups

        shapes = [(inputs(c), c.history) for c in self.pre if c.history]
        for b in self.blocks:
            shapes.append((b.up.weight.shape[0], b.up.history))
            for u in b.units:
                shapes += [(inputs(u.conv), u.conv.history), (inputs(u.conv), u.conv.pad)]
        shapes.append((inputs(self.final), self.final.history))
        return shapes

    def _delay(self) -> int:
        """Samples by which a step's output lags its input (the decoder's right receptive field)."""
        delay = sum(c.pad for c in self.pre)
        for b in self.blocks:
            delay = delay * b.up.stride + b.up.pad + sum(u.conv.pad for u in b.units)
        return delay + self.final.pad

    # -- shared pieces -----------------------------------------------------------------------------------

    def latent(self, codes: torch.Tensor) -> torch.Tensor:
        """z [B, latent_dim, 4 * frames] of codes [B, frames, 7] (the quantizer's `from_codes`)."""
        batch = codes.shape[0]
        z: Any = 0.0
        for table, cols in zip(self.tables, self.columns, strict=True):
            z = z + table[codes[:, :, cols].reshape(batch, -1)]
        return z.transpose(1, 2)

    def _noise(self, block: _Block, layer: int, x: torch.Tensor, seeds: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        if block.noise is None:
            return x
        noise = position_noise(seeds, layer, positions).to(x.dtype)[:, None, :]
        return x + noise * block.noise.valid(x)

    # -- full decode -------------------------------------------------------------------------------------

    def full(self, codes: torch.Tensor, offsets: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        """Float audio [B, 2048 * frames] of codes [B, frames, 7], zero-padded at both ends as `SNAC.decode`,
        with the noise of the positions starting at frame `offsets` [B] of streams `seeds` [B]."""
        x = self.latent(codes)
        for conv in self.pre:
            x = conv.full(x)
        per_frame = LATENT_PER_FRAME
        for layer, b in enumerate(self.blocks):
            x = b.up.full(b.snake(x))
            per_frame *= b.up.stride
            pos = (offsets * per_frame)[:, None] + torch.arange(x.shape[-1], device=x.device)[None, :]
            x = self._noise(b, layer, x, seeds, pos)
            for u in b.units:
                x = x + u.proj.valid(u.snake2(u.conv.full(u.snake1(x))))
        return torch.tanh(self.final.full(self.final_snake(x)))[:, 0, :]

    # -- streaming step ----------------------------------------------------------------------------------

    def stream(self, state: torch.Tensor, codes: torch.Tensor, frame: torch.Tensor, end: torch.Tensor,
               seeds: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Advance B streams by one chunk: `state` [B, state_size] (their pool rows), codes [B, k, 7] of frames
        [frame, frame + k), `end` [B] their length in frames (OPEN_END while unknown). Returns the audio of
        samples [2048 * frame - delay, 2048 * (frame + k) - delay) [B, 2048 k] and the new state rows.

        With `masked`, every layer's output is multiplied by a mask that is 0 outside [0, length) at its rate:
        the zero padding of the full decode at both ends (garbage before the start, the right padding after
        `end`). Rows whose step touches neither edge (`StreamingSnac.needs_mask`) give the same result
        without it, and save those passes over the activations."""
        batch = codes.shape[0]
        pieces = iter(self.state_shapes)
        offset = 0
        # The new state's pieces in `state_shapes` order, written by one `cat` at the end (not into slices of a
        # row: the module's Compilation says why).
        tails: list[torch.Tensor] = []

        def take() -> torch.Tensor:
            """The next state piece's old history [B, channels, keep]."""
            nonlocal offset
            channels, keep = next(pieces)
            old = state[:, offset:offset + channels * keep].view(batch, channels, keep)
            offset += channels * keep
            return old

        def exchange(fresh: torch.Tensor) -> torch.Tensor:
            """Kept history + fresh inputs (a convolution's input); keeps the new history. The tail comes from
            `fresh` where it is long enough: that second use makes Inductor write the concatenation once, `fresh`
            computed into it, where a concatenation used only by the taps is recomputed in each of the 7 (on a
            GPU; bench/snac_work.py counts both)."""
            old = take()
            keep = old.shape[-1]
            joined = torch.cat([old, fresh], dim=2)
            tail = fresh[..., -keep:] if fresh.shape[-1] >= keep else joined[..., -keep:]
            tails.append(tail.reshape(batch, -1))
            return joined

        def add_delayed(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
            """y + x delayed by the state piece's length (the residual skip); keeps x's tail."""
            old = take()
            keep, length = old.shape[-1], x.shape[-1]
            if keep > length:  # pragma: no cover - not in the 24 kHz model (chunks are longer than dilations)
                joined = torch.cat([old, x], dim=2)
                tails.append(joined[..., length:].reshape(batch, -1))
                return y + joined[..., :length]
            tails.append(x[..., length - keep:].reshape(batch, -1))
            if self.fusable:  # one select per value when compiled; slice adds into y become nested selects
                return y + torch.cat([old, x[..., :length - keep]], dim=2)
            y[..., :keep].add_(old)  # eager: no copy of x
            y[..., keep:].add_(x[..., :length - keep])
            return y

        def positions(per_frame: int, delay: int, length: int) -> torch.Tensor:
            return (frame * per_frame - delay)[:, None] + torch.arange(length, device=codes.device)[None, :]

        def mask(x: torch.Tensor, per_frame: int, delay: int, pos: torch.Tensor | None = None) -> torch.Tensor:
            if not masked:
                return x
            pos = positions(per_frame, delay, x.shape[-1]) if pos is None else pos
            valid = (pos >= 0) & (pos < (end * per_frame)[:, None])
            return x.mul_(valid.to(self.dtype)[:, None, :])

        per_frame, delay = LATENT_PER_FRAME, 0
        x = mask(self.latent(codes), per_frame, delay)
        for conv in self.pre:
            if conv.history:
                x = conv.valid(exchange(x))
                delay += conv.pad
            else:
                x = conv.valid(x)
            x = mask(x, per_frame, delay)
        for layer, b in enumerate(self.blocks):
            x = b.up.step(exchange(b.snake(x)))
            per_frame *= b.up.stride
            delay = delay * b.up.stride + b.up.pad
            pos = positions(per_frame, delay, x.shape[-1])
            x = self._noise(b, layer, mask(x, per_frame, delay, pos), seeds, pos)
            for u in b.units:
                y = u.proj.valid(u.snake2(u.conv.valid(exchange(u.snake1(x)))))
                delay += u.conv.pad
                x = mask(add_delayed(y, x), per_frame, delay)
        audio = torch.tanh(self.final.valid(exchange(self.final_snake(x))))[:, 0, :]
        delay += self.final.pad
        assert delay == self.delay and offset == state.shape[1]
        return audio, torch.cat(tails, dim=1)


# --- streams ----------------------------------------------------------------------------------------------


@dataclass(eq=False)
class StreamHandle:
    """One utterance being decoded: its pool slot, noise seed and host-side progress (read-only for callers)."""

    slot: int
    seed: int
    received: int = 0  # frames pushed
    stepped: int = 0  # frames consumed by steps (the next step starts at this frame)
    emitted: int = 0  # samples handed out (approximate first chunk included)
    finished: bool = False
    closed: bool = False
    handover: int = 0  # samples [0, handover) came from `bridge`
    bridged: int = 0  # frames the last `bridge` decode reached
    _pending: list[Frame] = field(default_factory=list)  # frames pushed, not yet stepped
    _head: list[Frame] = field(default_factory=list)  # the first MAX_HEAD_FRAMES frames (for `bridge`)
    _fade: np.ndarray | None = None  # approximate audio of [handover, handover + crossfade)

    @property
    def total_samples(self) -> int | None:
        """The utterance's length in samples, once `finish` was called."""
        return self.received * SAMPLES_PER_FRAME if self.finished else None

    @property
    def decoded_per_new_frame(self) -> float:
        """Frames this stream has run through the decoder per frame it was fed (flush steps included)."""
        return self.stepped / max(1, self.received)


@dataclass
class StreamStats:
    """Counters over all streams of a `StreamingSnac`."""

    launches: int = 0  # batched steps run (graph replays or eager passes)
    stream_steps: int = 0  # stream-steps in them (one chunk of one stream each)
    padded_rows: int = 0  # batch rows added to reach a graph bucket (wasted work)
    pushed_frames: int = 0
    stepped_frames: int = 0  # frames run through the exact decoder, flush steps included
    approx_frames: int = 0  # frames run through `bridge` decodes
    bridge_launches: int = 0  # bridge decodes (one per decode length per call)
    bridge_graphed: int = 0  # of them, graph replays

    @property
    def decoded_per_new_frame(self) -> float:
        """Frames decoded (exact steps + bridge decodes) per frame pushed; sliding 3-frame windows: ~2.9."""
        return (self.stepped_frames + self.approx_frames) / max(1, self.pushed_frames)


class _StepGraph:
    """The streaming step (masked or not) captured as a CUDA graph for one batch size, on static packed inputs.
    Rows beyond the batch are padding: scratch slot, end 0."""

    def __init__(self, run: Any, padding: torch.Tensor, pool: Any, capture: bool = True) -> None:
        """`padding`: [batch, width] rows that touch only the scratch slot (end 0: everything masked). Without
        `capture` (tests on CPU) the same static-input logic runs `run` eagerly."""
        self.batch = padding.shape[0]
        self._padding = padding
        self._run = run
        self.inputs = padding.clone()  # warm-up and capture runs touch the scratch slot only
        self.graph: Any = None
        if not capture:
            return
        device = padding.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):  # TorchScript (snake) profiles, then fuses, before the capture
                run(self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.audio, self.pcm = run(self.inputs)

    def __call__(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = packed.shape[0]
        self.inputs[:rows].copy_(packed, non_blocking=True)
        if rows < self.batch:
            self.inputs[rows:].copy_(self._padding[rows:])
        if self.graph is None:
            self.audio, self.pcm = self._run(self.inputs)
        else:
            self.graph.replay()
        return self.audio[:rows], self.pcm[:rows]


class StreamingSnac:
    """Exact incremental SNAC decoding of many streams, batched across streams at different positions.

    Typical use, from one thread (the decoder is not thread-safe)::

        snac = StreamingSnac.load("hubertsiuzdak/snac_24khz", "cuda", "bfloat16", max_streams=512)
        h = snac.open_stream(seed=utterance_id)
        snac.push(h, frames)                    # as the LLM produces them
        fast = snac.bridge([h], lookahead=0)[0] # optional fast start (approximate, crossfaded later)
        pcm = snac.step_batch(ready_handles)    # each tick: one frame per ready stream, one or two launches
        snac.finish(h)                          # end of speech: later steps flush the tail
        ...until snac.done(h); snac.close(h)
    """

    HEAD_FRAMES = MAX_HEAD_FRAMES  # for callers without torch (the stream decoder): the bridge's reach

    def __init__(self, model: Any, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 max_streams: int = 64, chunk_frames: int = 1, compile: bool = False) -> None:
        """`model`: a `snac.SNAC` (24 kHz config); its decoder weights are copied, the model is not kept.
        `compile`: the streaming step through torch.compile (the module's Compilation)."""
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if chunk_frames < 1 or max_streams < 1:
            raise ValueError("chunk_frames and max_streams must be >= 1")
        self.max_streams = max_streams
        self.chunk_frames = chunk_frames
        self.decoder = _Decoder(model, self.device, self.dtype, fusable=compile)
        self.compiled = compile
        # One compile per `masked` value: the batch dimension is marked dynamic (`_run_packed`) and never 1.
        self._stream = (torch.compile(self.decoder.stream, fullgraph=True, dynamic=False) if compile
                        else self.decoder.stream)
        self.delay_samples = self.decoder.delay
        self.chunk_samples = chunk_frames * SAMPLES_PER_FRAME
        # Pool of stream states; row max_streams is the scratch slot of padded batch rows.
        self.pool = torch.zeros((max_streams + 1, self.decoder.state_size), dtype=self.dtype, device=self.device)
        self._free = list(range(max_streams - 1, -1, -1))
        self._seeds = itertools.count(1)
        self._codes_width = chunk_frames * SLOTS_PER_FRAME
        self._width = self._codes_width + 4  # codes, slot, first frame, end (frames), seed
        self._graphs: dict[tuple[bool, int], _StepGraph] = {}  # (masked, batch) -> graph
        self._bridge_graphs: dict[tuple[int, int], _StepGraph] = {}  # (frames, batch) -> graph
        # Per launch of a tick and per bridge length (pinned on CUDA).
        self._host_buffers: dict[tuple[str, int], torch.Tensor] = {}
        # The wait for the GPU (a tick's steps, a bridge decode). A blocking event: the thread sleeps until the
        # work is done, where a stream sync spins (CUDA's default with fewer contexts than cores) and holds a core
        # all along. The decoder thread used ~2/3 of a core at 384 streams on the H200 (2026-12-04), its host work
        # ~1.4 ms per tick of that (gateway.benchmarks.decoder_host): the rest was spinning.
        self._device_done = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        self.stats = StreamStats()

    @classmethod
    def load(cls, name_or_path: str, device: str = "auto", dtype: str = "auto", max_streams: int = 64,
             chunk_frames: int = 1, capture_graphs: bool = True, max_batch: int | None = None,
             compile: bool | None = None) -> StreamingSnac:
        """Load a SNAC checkpoint (hub name or folder) and build the streaming decoder on `device` in `dtype`
        ("auto": `snac_device_and_dtype`), its step compiled with `compile` (None: `snac_compiles`) before
        anything runs. On CUDA with `capture_graphs`, graphs for batch buckets up to `max_batch` (default:
        min(max_streams, 512)) are captured at once.

        Where compiling was only the default (`compile` None) and fails (no Triton for this GPU, no C compiler),
        the step runs eagerly with a warning: exact all the same, ~2.2x the GPU time on an H200. Asked for by
        name, its failure stops the start."""
        from snac import SNAC

        device, dtype = snac_device_and_dtype(device, dtype)
        model = SNAC.from_pretrained(name_or_path).eval()
        snac = cls(model, device, dtype, max_streams, chunk_frames, snac_compiles(device, compile))
        try:
            snac.precompile()  # a compiler that cannot work fails here, before any graph capture
        except Exception as exc:
            if compile is not None:
                raise
            log.warning("SNAC: compiling the decoder's step failed (%s: %s); it runs eagerly (--no-snac-compile "
                        "skips the attempt)", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            snac = cls(model, device, dtype, max_streams, chunk_frames, False)
        if capture_graphs:
            snac.capture_graphs(max_batch)
        return snac

    # -- device-level step ---------------------------------------------------------------------------------

    def _run_packed(self, packed: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on packed rows [B, 7k + 4] (codes, slot, first frame, end, seed), all on the device: gather
        the states, advance, scatter them back; float32 audio and int16 PCM [B, 2048 k]."""
        rows = packed.shape[0]
        if self.compiled and rows < COMPILED_MIN_BATCH:
            padded = torch.cat([packed, self._padding_rows(COMPILED_MIN_BATCH - rows)])
            audio, pcm = self._run_packed(padded, masked)
            return audio[:rows], pcm[:rows]
        w = self._codes_width
        slots = packed[:, w]
        codes = packed[:, :w].reshape(-1, self.chunk_frames, SLOTS_PER_FRAME)
        inputs = (self.pool.index_select(0, slots), codes, packed[:, w + 1], packed[:, w + 2], packed[:, w + 3])
        if self.compiled:
            for tensor in inputs:
                torch._dynamo.mark_dynamic(tensor, 0)
        audio, new_state = self._stream(*inputs, masked)
        self.pool.index_copy_(0, slots, new_state)
        audio = audio.float()
        return audio, (audio.clamp(-1.0, 1.0) * INT16_MAX).to(torch.int16)

    def _run_bridge(self, packed: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A bridge decode on packed rows [B, 7 frames + 2] (codes, first frame, seed): float32 audio
        [B, 2048 frames] (twice: a graph's outputs are a pair)."""
        w = frames * SLOTS_PER_FRAME
        codes = packed[:, :w].reshape(-1, frames, SLOTS_PER_FRAME)
        audio = self.decoder.full(codes, packed[:, w], packed[:, w + 1]).float()
        return audio, audio

    def _bridge_decode(self, codes: list[list[Frame]], offsets: list[int], seeds: list[int]) -> np.ndarray:
        """Float32 audio [n, 2048 frames] of n equal-length bridge windows: captured graphs where they exist for
        the length (more rows than the largest bucket: several replays of it), else eagerly. One host sync.

        Replays, not one eager decode, for a burst's many first pieces: an eager decode is ~175 launches, and
        with vLLM's engine in another process each can wait for the GPU to switch contexts (at 128 users on an
        H200, first audio came in waves ~80 ms apart, 2026-12-05)."""
        frames = len(codes[0])
        rows = np.array([[*itertools.chain.from_iterable(c), o, s] for c, o, s in zip(codes, offsets, seeds,
                                                                                    strict=True)], dtype=np.int64)
        buckets = sorted(b for f, b in self._bridge_graphs if f == frames)
        part = buckets[-1] if buckets else len(rows)
        cuda = self.device.type == "cuda"
        host = self._host_buffer(("bridge", frames), (len(rows), frames * SAMPLES_PER_FRAME), torch.float32,
                                 pinned=cuda)[:len(rows)]
        with torch.inference_mode():
            packed = torch.from_numpy(rows).to(self.device)
            for start in range(0, len(rows), part):
                chunk = packed[start:start + part]
                bucket = next((b for b in buckets if b >= chunk.shape[0]), None)
                self.stats.bridge_launches += 1
                if bucket is None:
                    audio, _ = self._run_bridge(chunk, frames)
                else:
                    self.stats.bridge_graphed += 1
                    audio, _ = self._bridge_graphs[frames, bucket](chunk)
                # Stream-ordered: the copy reads this replay's output before the next replay reuses its memory.
                host[start:start + chunk.shape[0]].copy_(audio, non_blocking=cuda)
            self._wait_for_device()
            return host.numpy().copy()  # the host buffer serves the next bridge decode of this length

    def capture_graphs(self, max_batch: int | None = None, buckets: Sequence[int] = GRAPH_BATCH_BUCKETS, *,
                       emulate: bool = False) -> None:
        """CUDA-graph the step, masked and unmasked, for the batch `buckets` up to `max_batch` (default:
        min(max_streams, 512)), and the bridge's common decodes (`BRIDGE_GRAPH_FRAMES` x `BRIDGE_GRAPH_BUCKETS`);
        GPU only (no-op elsewhere). All graphs share one memory pool (captured largest
        first): their outputs are valid until the next launch. `emulate` (tests, any device) sets up the same
        buckets, static inputs and padded rows but runs them eagerly instead of capturing."""
        cuda = self.device.type == "cuda"
        if not (cuda or emulate):
            return
        top = min(max_batch or 512, self.max_streams)
        smallest = COMPILED_MIN_BATCH if self.compiled else 1
        sizes = sorted({max(b, smallest) for b in buckets if b < top} | {max(top, smallest)})
        pool = torch.cuda.graph_pool_handle() if cuda and not emulate else None
        with torch.inference_mode():
            for size in reversed(sizes):
                for masked in (True, False):
                    run = functools.partial(self._run_packed, masked=masked)
                    padding = self._padding_rows(size)
                    self._graphs[masked, size] = _StepGraph(run, padding, pool, capture=pool is not None)
            for frames in BRIDGE_GRAPH_FRAMES:
                for size in reversed([b for b in BRIDGE_GRAPH_BUCKETS if b <= top]):
                    run = functools.partial(self._run_bridge, frames=frames)
                    padding = torch.zeros((size, frames * SLOTS_PER_FRAME + 2), dtype=torch.int64,
                                          device=self.device)
                    self._bridge_graphs[frames, size] = _StepGraph(run, padding, pool, capture=pool is not None)

    def precompile(self) -> None:
        """With `compile`, compile both step graphs now (a padded step on the scratch slot each) instead of in the
        first utterance's tick (minutes on a small CPU) or inside a graph capture, so a compiler that cannot work
        fails at start-up (`load` calls it). A no-op once graphs are set up: their capture compiled them."""
        if not self.compiled or self._graphs:
            return
        with torch.inference_mode():
            for masked in (True, False):
                self._run_packed(self._padding_rows(COMPILED_MIN_BATCH), masked)

    def _padding_rows(self, rows: int) -> torch.Tensor:
        padding = torch.zeros((rows, self._width), dtype=torch.int64, device=self.device)
        padding[:, self._codes_width] = self.max_streams
        return padding

    def step(self, slots: torch.Tensor, codes: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor,
             seeds: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Device-level step of B streams (no host sync): `slots` [B] pool rows, `codes` [B, k, 7] the next
        chunk of each stream, `positions` [B] the chunk's first frame, `ends` [B] each stream's length in
        frames (OPEN_END while open; steps past the end flush), `seeds` [B]. `masked=False` skips the edge
        masks: exact only for rows where `needs_mask` is false. Returns float32 audio and int16 PCM [B, 2048 k] of
        samples [2048 * position - delay_samples, ... + 2048 k) (CUDA-graph outputs: valid until the next
        launch)."""
        packed = torch.cat([codes.reshape(codes.shape[0], -1), slots[:, None], positions[:, None], ends[:, None],
                            seeds[:, None]], dim=1).to(device=self.device, dtype=torch.int64)
        return self._launch(packed, masked)

    def needs_mask(self, handle: StreamHandle) -> bool:
        """Whether the stream's next step touches an edge: some layer still has samples before the start (the
        first ceil(delay_samples / 2048) = 3 steps) or the chunk passes the end (flush steps)."""
        return (handle.stepped * SAMPLES_PER_FRAME < self.delay_samples
                or handle.stepped + self.chunk_frames > handle.received)

    def _launch(self, packed: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        rows = packed.shape[0]
        self.stats.launches += 1
        with torch.inference_mode():
            bucket = next((b for m, b in sorted(self._graphs) if m == masked and b >= rows), None)
            if bucket is None:
                return self._run_packed(packed, masked)
            self.stats.padded_rows += bucket - rows
            return self._graphs[masked, bucket](packed)

    def _max_rows(self) -> int:
        return max(b for _, b in self._graphs) if self._graphs else self.max_streams

    # -- streams -------------------------------------------------------------------------------------------

    def open_stream(self, seed: int | None = None) -> StreamHandle:
        """A new stream in a free slot (its state zeroed). `seed` keys its noise (default: a counter); the same
        seed and frames always give the same audio. Raises RuntimeError when all `max_streams` are open."""
        if not self._free:
            raise RuntimeError(f"all {self.max_streams} stream slots are in use")
        slot = self._free.pop()
        with torch.inference_mode():
            self.pool[slot].zero_()
        return StreamHandle(slot=slot, seed=(next(self._seeds) if seed is None else seed) & ((1 << 63) - 1))

    def push(self, handle: StreamHandle, frames: Sequence[Frame]) -> None:
        """Append frames (7 codes each, 0..4095) to the stream; they are decoded by later steps."""
        if handle.closed or handle.finished:
            raise ValueError("push to a finished or closed stream")
        if frames:
            codes = np.asarray(frames)
            if codes.ndim != 2 or codes.shape[1] != SLOTS_PER_FRAME or codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
                raise ValueError(f"frames must be {SLOTS_PER_FRAME} codes in [0, {CODEBOOK_SIZE}) each")
        handle._pending.extend(frames)
        room = MAX_HEAD_FRAMES - len(handle._head)
        if room > 0:
            handle._head.extend(frames[:room])
        handle.received += len(frames)
        self.stats.pushed_frames += len(frames)

    def finish(self, handle: StreamHandle) -> None:
        """No more frames: the stream's next steps flush its tail with the full decode's right zero padding
        (ceil(delay_samples / 2048 k) steps), after which `done` is true."""
        handle.finished = True

    def ready(self, handle: StreamHandle) -> bool:
        """Whether `step_batch` would advance this stream: a whole chunk is pending, or it is finished and not
        all its audio is out yet."""
        if handle.closed:
            return False
        if handle.finished:
            return handle.emitted < handle.received * SAMPLES_PER_FRAME
        return len(handle._pending) >= self.chunk_frames

    def done(self, handle: StreamHandle) -> bool:
        """Finished and all its audio handed out."""
        return handle.finished and handle.emitted >= handle.received * SAMPLES_PER_FRAME

    def close(self, handle: StreamHandle) -> None:
        """Release the stream's slot (at any time; unfinished audio is dropped)."""
        if not handle.closed:
            handle.closed = True
            handle._pending.clear()
            self._free.append(handle.slot)

    def step_batch(self, handles: Sequence[StreamHandle], *, as_float: bool = False) -> list[np.ndarray]:
        """Advance every ready handle by one chunk: the streams at an edge (first 3 steps, flush) in one masked
        launch, the others in one unmasked launch (more if a kind exceeds the largest graph bucket). Returns each
        handle's new audio: int16 PCM (float32 in [-1, 1] with `as_float`), empty
        for handles that were not ready or whose new samples all lie before the start (the first two steps)
        or before the audio `bridge` handed out. One host sync per tick, none per launch or stream."""
        out = [np.zeros(0, dtype=np.float32 if as_float else np.int16) for _ in handles]
        active = [(i, h) for i, h in enumerate(handles) if self.ready(h)]
        if len({h.slot for _, h in active}) != len(active):
            raise ValueError("a stream appears twice in one step")
        top = self._max_rows()
        # Streams at an edge (start or flush) run the masked step, the others the cheaper unmasked one.
        edge = [(i, h) for i, h in active if self.needs_mask(h)]
        steady = [(i, h) for i, h in active if not self.needs_mask(h)]
        launches = [(True, edge[at:at + top]) for at in range(0, len(edge), top)]
        launches += [(False, steady[at:at + top]) for at in range(0, len(steady), top)]
        k = self.chunk_frames
        silence = [(0,) * SLOTS_PER_FRAME] * k  # past the end: any codes (masked)
        results: list[tuple[list[tuple[int, StreamHandle]], np.ndarray]] = []
        for part, (masked, group) in enumerate(launches):
            rows = np.array([[*itertools.chain.from_iterable((h._pending[:k] + silence)[:k]), h.slot, h.stepped,
                              h.received if h.finished else OPEN_END, h.seed] for _, h in group], dtype=np.int64)
            audio, pcm = self._launch(self._to_device(rows, part), masked)
            # Copied out in stream order, before the next launch may reuse the graphs' shared output memory.
            results.append((group, self._to_host(audio if as_float else pcm, ("out", part), self._max_rows())))
        if launches:
            self._wait_for_device()  # one host sync for all of the tick's launches
        for group, reused in results:
            data = reused.copy()  # the pieces handed out are views of it; the next tick overwrites the buffer
            for r, (i, h) in enumerate(group):
                out[i] = self._emit(h, data[r], as_float)
                del h._pending[:k]
                h.stepped += k
            self.stats.stream_steps += len(group)
            self.stats.stepped_frames += len(group) * k
        return out

    def _to_device(self, rows: np.ndarray, part: int) -> torch.Tensor:
        """The tick's `part`-th launch's packed rows on the device: through its own pinned staging buffer, whose
        previous copy ended with the last tick's sync."""
        if self.device.type != "cuda":
            return torch.from_numpy(rows).to(self.device)
        staging = self._host_buffer(("in", part), (self._max_rows(), self._width), torch.int64,
                                    pinned=True)[:rows.shape[0]]
        staging.numpy()[:] = rows
        return staging.to(self.device, non_blocking=True)

    def _to_host(self, result: torch.Tensor, key: tuple[str, int], capacity: int = 0) -> np.ndarray:
        """A launch's output in the host buffer `key` names (of at least `capacity` rows), which every later launch
        of its kind reuses (on every device, so the CPU tests see the reuse the GPU has): on CUDA a pinned buffer
        and an asynchronous copy, valid after `_wait_for_device`."""
        cuda = self.device.type == "cuda"
        host = self._host_buffer(key, (max(capacity, result.shape[0]), result.shape[1]), result.dtype,
                                 pinned=cuda)[:result.shape[0]]
        host.copy_(result, non_blocking=cuda)
        return host.numpy()

    def _wait_for_device(self) -> None:
        """Until the device has done what was launched (on CUDA: on a blocking event, `_device_done`)."""
        if self._device_done is not None:
            self._device_done.record(torch.cuda.current_stream(self.device))
            self._device_done.synchronize()

    def _host_buffer(self, key: tuple[str, int], shape: tuple[int, int], dtype: torch.dtype,
                     pinned: bool) -> torch.Tensor:
        buffer = self._host_buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.shape[0] < shape[0] or buffer.shape[1] != shape[1]:
            buffer = torch.empty(shape, dtype=dtype)
            buffer = self._host_buffers[key] = buffer.pin_memory() if pinned else buffer
        return buffer

    def _emit(self, handle: StreamHandle, chunk: np.ndarray, as_float: bool) -> np.ndarray:
        """The part of a step's output that is new audio, crossfaded with the first chunk where it overlaps."""
        start = handle.stepped * SAMPLES_PER_FRAME - self.delay_samples
        stop = start + chunk.shape[0]
        if handle.finished:
            stop = min(stop, handle.received * SAMPLES_PER_FRAME)
        lo = max(handle.emitted, start)
        if stop <= lo:
            return chunk[:0]
        piece = chunk[lo - start:stop - start]
        handle.emitted = stop
        fade = handle._fade
        if fade is not None and lo < handle.handover + fade.shape[0]:
            a, b = lo - handle.handover, min(stop - handle.handover, fade.shape[0])
            exact = piece[:b - a].astype(np.float32) / (1.0 if as_float else INT16_MAX)
            weight = _fade_in(fade.shape[0])[a:b]
            mixed = (1.0 - weight) * fade[a:b] + weight * exact
            piece = piece.copy()
            piece[:b - a] = mixed if as_float else _to_int16(mixed)
            if b == fade.shape[0]:
                handle._fade = None
        return piece

    def drain(self, handles: Sequence[StreamHandle], *, as_float: bool = False) -> list[np.ndarray]:
        """Run `step_batch` until no handle is ready; each handle's audio of all those steps, concatenated."""
        pieces: list[list[np.ndarray]] = [[] for _ in handles]
        while any(self.ready(h) for h in handles):
            for i, piece in enumerate(self.step_batch(handles, as_float=as_float)):
                pieces[i].append(piece)
        dtype = np.float32 if as_float else np.int16
        return [np.concatenate(p) if p else np.zeros(0, dtype=dtype) for p in pieces]

    # -- fast start: the bridge ------------------------------------------------------------------------

    def bridging_over(self, handle: StreamHandle) -> bool:
        """Whether `bridge` can give this stream no more audio: the exact stream has taken over (it handed out
        audio past the bridge's), the stream is done or closed, or its bridged frames reached MAX_HEAD_FRAMES."""
        return (handle.closed or handle.emitted > handle.handover or self.done(handle)
                or handle.bridged >= MAX_HEAD_FRAMES)

    @staticmethod
    def check_bridge(lookahead: int, crossfade: int = 0) -> None:
        """The bounds of `bridge`'s arguments: ValueError outside them."""
        if not 0 <= crossfade <= SAMPLES_PER_FRAME or not 0 <= lookahead < MAX_HEAD_FRAMES:
            raise ValueError(f"crossfade must be in [0, {SAMPLES_PER_FRAME}] samples and the lookahead in "
                             f"[0, {MAX_HEAD_FRAMES - 1}] frames")

    def bridgeable(self, handle: StreamHandle, lookahead: int = 1, crossfade: int = 512) -> bool:
        """Whether `bridge` would hand out audio for this stream now."""
        return self._bridge_plan(handle, lookahead, crossfade) is not None

    def _bridge_plan(self, h: StreamHandle, lookahead: int, crossfade: int) -> tuple[int, int, int, bool] | None:
        """(first frame, frames, reach, whole) of the stream's next bridge decode, or None if it would add no
        audio. `whole`: the decode ends at the utterance's true end (finished, all frames within the head)."""
        if h.received == 0 or self.bridging_over(h):
            return None
        frames = min(h.received, MAX_HEAD_FRAMES)
        whole = h.finished and h.received == frames
        if frames <= h.bridged and not whole:
            return None
        total = frames * SAMPLES_PER_FRAME
        reach = total if whole else min((frames - lookahead) * SAMPLES_PER_FRAME, total - crossfade)
        fading = 0 if h._fade is None else h._fade.shape[0]
        if reach <= h.emitted or reach < h.emitted + fading:
            return None
        # Left context for the samples it hands out; the whole utterance's end decodes from frame 0, so it is exact.
        first = 0 if whole else max(0, h.emitted // SAMPLES_PER_FRAME - BRIDGE_CONTEXT_FRAMES)
        return first, frames - first, reach, whole

    def bridge(self, handles: Sequence[StreamHandle], lookahead: int = 1, crossfade: int = 512, *,
               as_float: bool = False) -> list[np.ndarray]:
        """Fast, approximate audio of streams the exact stream has not taken over yet, ahead of it: a decode of
        their latest frames (up to the first MAX_HEAD_FRAMES; BRIDGE_CONTEXT_FRAMES of left context, zero padding
        after the last frame, as a sliding window decodes), of which the audio up to `lookahead` frames before
        its end is handed out (at most `crossfade` samples before the end: those are kept to fade into what
        comes next). Each call continues the last one with a raised-cosine crossfade of `crossfade` samples, and
        the exact stream takes over the same way once it is past the bridge's audio: `step_batch` hands out
        nothing before then, and from the end of that crossfade on the audio is exact. Where the decode reaches
        the end of a finished utterance, it decodes from frame 0 and all of it is exact (the stream is done).

        Handles with nothing to add get empty audio. Batched per decode length; the common lengths replay a
        captured graph (`capture_graphs`), the others run eagerly. `lookahead` 0 hands out a frame as soon as it
        is in (the fastest first audio)."""
        self.check_bridge(lookahead, crossfade)
        out = [np.zeros(0, dtype=np.float32 if as_float else np.int16) for _ in handles]
        groups: dict[int, list[tuple[int, StreamHandle, int, int, bool]]] = {}
        for i, h in enumerate(handles):
            plan = self._bridge_plan(h, lookahead, crossfade)
            if plan is not None:
                first, frames, reach, whole = plan
                groups.setdefault(frames, []).append((i, h, first, reach, whole))
        for frames, group in sorted(groups.items()):
            audio = self._bridge_decode([h._head[first:first + frames] for _, h, first, _, _ in group],
                                        [first for _, _, first, _, _ in group], [h.seed for _, h, _, _, _ in group])
            self.stats.approx_frames += frames * len(group)
            for row, (i, h, first, reach, whole) in enumerate(group):
                base = first * SAMPLES_PER_FRAME
                piece = audio[row, h.emitted - base:reach - base]
                if h._fade is not None:  # continue the last bridge's audio without a step
                    n = h._fade.shape[0]
                    weight = _fade_in(n)
                    piece = piece.copy()
                    piece[:n] = (1.0 - weight) * h._fade + weight * piece[:n]
                h._fade = audio[row, reach - base:reach - base + crossfade].copy() if crossfade and not whole \
                    else None
                h.handover = h.emitted = reach
                h.bridged = min(h.received, MAX_HEAD_FRAMES)
                out[i] = piece if as_float else _to_int16(piece)
        return out


def _fade_in(length: int) -> np.ndarray:
    """Raised-cosine weights of the incoming (exact) signal over a crossfade of `length` samples."""
    return (0.5 - 0.5 * np.cos(np.pi * (np.arange(length, dtype=np.float32) + 0.5) / length)).astype(np.float32)


def _to_int16(audio: np.ndarray) -> np.ndarray:
    """float [-1, 1] -> int16 as the decoder's own conversion does (scale by 32767, truncate toward zero)."""
    return (np.clip(audio, -1.0, 1.0) * INT16_MAX).astype(np.int16)
