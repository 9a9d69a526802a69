"""SNAC's 24 kHz decoder as plain tensors, run two ways: a full padded decode (the bridge's) and an exact streaming
step that keeps every layer's left context in a per-stream state row, so each code frame runs through the decoder
once and the audio equals a full `SNAC.decode`. Also the position-tied noise that makes that equality testable:
the noise of a sample is a hash of (stream seed, layer, absolute position), however the frames are chunked.
Receptive field, exactness and chunk size: docs/decisions/snac-exactness-and-bridge.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from snac.layers import DecoderBlock, NoiseBlock, ResidualUnit, Snake1d, snake
from torch.nn import functional as nnf

from gateway.orpheus import SAMPLES_PER_FRAME, SLOTS_PER_FRAME, frames_to_layers

OPEN_END = 1 << 40  # "end" (in frames) of a stream that has not finished

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
    phases: torch.Tensor | None = None  # the weight as `kernels.block_head` reads it, where the step uses it

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


class DecoderLayers:
    """SNAC's decoder as plain tensors, run two ways: a full padded decode and a streaming step."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype, fusable: bool = False,
                 kernels: bool = False, head_kernels: bool = False) -> None:
        """`fusable`: the streaming step written for torch.compile to fuse (depthwise convolutions as shifted
        products, residual skips as selects) rather than for eager kernels; the same numbers. `kernels`: the
        streaming step's residual units as one fused kernel each (`kernels.residual_unit_op`; CUDA, or Triton's
        interpreter in tests). `head_kernels`: each block's Snake and transposed convolution as one kernel
        (`kernels.block_head_op`; docs/decisions/snac-kernels.md, "Block heads")."""
        if getattr(model, "attn_window_size", None) is not None:
            raise ValueError("SNAC models with local attention (32/44 kHz) are not streamable here")
        if list(model.vq_strides) != [LATENT_PER_FRAME, 2, 1]:
            raise ValueError(f"expected vq_strides [4, 2, 1] (Orpheus' 24 kHz SNAC), got {model.vq_strides}")
        self.device, self.dtype, self.fusable, self.kernels = device, dtype, fusable, kernels
        self.head_kernels = head_kernels
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
            if head_kernels:
                from gateway.speech.snac.kernels import head_phases

                for b in self.blocks:
                    b.up.phases = head_phases(b.up.weight, b.up.stride)
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
        # The new state's pieces in `state_shapes` order, written by one `cat` at the end, never into slices of a
        # row (docs/decisions/exact-streaming-snac-decoder.md).
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
            computed into it, where a concatenation used only by the taps is recomputed in each of the 7
            (gateway/benchmarks/snac_work.py counts both)."""
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
        if self.kernels:  # the kernels read one value per row
            frame, end = frame.contiguous(), end.contiguous()
        x = mask(self.latent(codes), per_frame, delay)
        for conv in self.pre:
            if conv.history:
                x = conv.valid(exchange(x))
                delay += conv.pad
            else:
                x = conv.valid(x)
            x = mask(x, per_frame, delay)
        for layer, b in enumerate(self.blocks):
            if self.head_kernels:  # the Snake inside the kernel; here only the kept input's, for the state
                from gateway.speech.snac.kernels import block_head_op

                kept = take()
                tails.append(b.snake(x[..., x.shape[-1] - kept.shape[-1]:]).reshape(batch, -1))
                x = block_head_op(kept, x, b.snake.alpha, b.up.phases, b.up.bias, b.up.stride)
            else:
                x = b.up.step(exchange(b.snake(x)))
            per_frame *= b.up.stride
            delay = delay * b.up.stride + b.up.pad
            pos = positions(per_frame, delay, x.shape[-1])
            x = self._noise(b, layer, mask(x, per_frame, delay, pos), seeds, pos)
            for u in b.units:
                if self.kernels:  # snake1 and its history by `exchange`, the rest in one kernel
                    from gateway.speech.snac.kernels import residual_unit_op

                    joined = exchange(u.snake1(x))
                    x_old = take()
                    tails.append(x[..., x.shape[-1] - x_old.shape[-1]:].reshape(batch, -1))
                    delay += u.conv.pad
                    x = residual_unit_op(joined, x, x_old, u.snake2.alpha, u.conv.weight, u.conv.bias,
                                         u.proj.weight, u.proj.bias, u.conv.dilation, frame, end, per_frame, delay,
                                         masked)
                    continue
                y = u.proj.valid(u.snake2(u.conv.valid(exchange(u.snake1(x)))))
                delay += u.conv.pad
                x = mask(add_delayed(y, x), per_frame, delay)
        audio = torch.tanh(self.final.valid(exchange(self.final_snake(x))))[:, 0, :]
        delay += self.final.pad
        assert delay == self.delay and offset == state.shape[1]
        return audio, torch.cat(tails, dim=1)
