"""Triton kernels of the exact streaming step, used on CUDA (`--snac-kernels`) in place of the layers they fuse;
`layers.DecoderLayers` keeps the reference path with the same numbers up to the rounding of the step's precision.

`residual_unit`: a ResidualUnit step after its first Snake, x + proj(snake2(dwconv7(s))) with s = snake1(x) after
the kept history (written once by the compiled step, as its state needs it), the skip's history and the edge
mask: each tile reads its inputs once and writes its output once, where the layer-by-layer step makes four more
passes; the 1x1 projection runs on tensor cores.

`block_head`: a decoder block's head, its Snake then its ConvTranspose1d (stride s, kernel 2 s) as the step
computes it, in one pass: output phase r of new input t is W[:, :, r] snake(x[t]) + W[:, :, r + s] snake(x[t - 1])
(the kept Snake output before the first), the phases as one matrix product on tensor cores, written interleaved.
On with the residual units' kernels (`StreamingSnac.load`): measured faster than the compiled step's transposed
convolutions.
Why: docs/decisions/snac-kernels.md. Exactness: tests/test_snac_kernels.py (the interpreter on a CPU) and
tools/device/snac_stream_bench.py (the card).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

TAPS = 7  # SNAC's residual units: depthwise k7 convolutions, dilations 1, 3, 9 (snake's epsilon: 1e-9, as snac's)


@functools.cache
def _triton() -> Any:
    """The triton module, or None where it cannot run these kernels."""
    try:
        import triton
        import triton.language
    except ImportError:
        return None
    return triton


def kernels_available(device: torch.device) -> bool:
    """Whether the fused kernels can run on `device`: CUDA with Triton (the interpreter runs them on a CPU, for
    tests only)."""
    return device.type == "cuda" and _triton() is not None and torch.cuda.is_available()


@functools.cache
def _unit_kernel() -> Any:
    from gateway.speech.snac.unit_kernel import unit_kernel

    return unit_kernel


@functools.cache
def _head_kernel() -> Any:
    from gateway.speech.snac.head_kernel import head_kernel

    return head_kernel


def _whole(length: int, least: int = 1) -> int:
    """The power of two at or above max(least, length): a tile that holds `length` samples."""
    return 1 << (max(least, length) - 1).bit_length()


def tile_warps(outputs: int) -> int:
    """Warps of a program whose tile holds `outputs` float32 sums: 8 from 8192 (with 4 they spill registers,
    tools/device/snac_kernel_resources.py), else 4."""
    return 8 if outputs >= 8192 else 4


def unit_tiles(channels: int, length: int, interpreted: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_R, BLOCK_T, BLOCK_CO, BLOCK_CI, num_warps) of a unit of `channels` over `length` samples: 64 columns
    a tile (one stream's samples, or short streams side by side), up to 256 output channels a program (the
    depthwise part is computed once per output block) and input channels in blocks of 64: the fastest of the
    tiles measured per unit shape (docs/decisions/snac-kernels.md). `interpreted` (Triton's interpreter, on a
    CPU): one tile per stream and channel block, each op one numpy call over it."""
    whole = _whole(length, 16)
    if interpreted:
        return 1, whole, min(channels, 128), channels, 4
    block_t = min(64, whole)
    block_r = max(1, 64 // block_t)
    block_co = min(channels, 256)
    block_ci = min(channels, 64)
    return block_r, block_t, block_co, block_ci, tile_warps(block_co * block_t * block_r)


def residual_unit(joined: torch.Tensor, x: torch.Tensor, x_history: torch.Tensor, alpha2: torch.Tensor,
                  dw_weight: torch.Tensor, dw_bias: torch.Tensor | None, pw_weight: torch.Tensor,
                  pw_bias: torch.Tensor | None, dilation: int, frame: torch.Tensor, end: torch.Tensor,
                  per_frame: int, delay: int, masked: bool,
                  tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """One ResidualUnit step of B streams: `joined` [B, C, 6 d + L] the depthwise convolution's input (the kept
    snake1 outputs, then snake1 of the fresh input), `x` [B, C, L] the fresh input, `x_history` [B, C, 3 d] the
    kept inputs (all time contiguous, any batch/channel strides); weights as `layers._Unit` holds them. With
    `masked`, outputs outside [0, end * per_frame) at positions frame * per_frame - delay + t are 0 (`delay`
    counts this unit's padding); `tiles`: `unit_tiles`' choice unless given. Returns [B, C, L] in x's dtype."""
    batch, channels, length = x.shape
    for name, t in (("joined", joined), ("x", x), ("x_history", x_history)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in time")
    if joined.shape[-1] != length + (TAPS - 1) * dilation:
        raise ValueError(f"joined holds {joined.shape[-1]} samples, not {length} + {(TAPS - 1) * dilation}")
    if not (frame.is_contiguous() and end.is_contiguous()):
        raise ValueError("frame and end must be contiguous")
    out = torch.empty((batch, channels, length), dtype=x.dtype, device=x.device)
    block_r, block_t, block_co, block_ci, warps = tiles or unit_tiles(channels, length,
                                                                      interpreted=x.device.type == "cpu")
    grid = (-(-batch // block_r), -(-length // block_t), -(-channels // block_co))
    dummy = pw_weight  # any tensor: the bias pointers are not read without a bias
    _unit_kernel()[grid](
        joined, joined.stride(0), joined.stride(1), x, x.stride(0), x.stride(1),
        x_history, x_history.stride(0), x_history.stride(1), out, out.stride(0), out.stride(1),
        alpha2.reshape(-1), dw_weight.reshape(channels, TAPS).contiguous(),
        dummy if dw_bias is None else dw_bias, pw_weight.reshape(channels, channels).contiguous(),
        dummy if pw_bias is None else pw_bias, frame, end, length, per_frame, delay,
        C=channels, K=TAPS, DIL=dilation, MASKED=masked, HAS_DW_BIAS=dw_bias is not None,
        HAS_PW_BIAS=pw_bias is not None, LOW_PRECISION=x.dtype != torch.float32,
        batch=batch, BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_CO=block_co, BLOCK_CI=block_ci, num_warps=warps,
        num_stages=1)
    return out


@torch.library.custom_op("orpheus_gateway::snac_residual_unit", mutates_args=())
def residual_unit_op(joined: torch.Tensor, x: torch.Tensor, x_history: torch.Tensor, alpha2: torch.Tensor,
                     dw_weight: torch.Tensor, dw_bias: torch.Tensor | None, pw_weight: torch.Tensor,
                     pw_bias: torch.Tensor | None, dilation: int, frame: torch.Tensor, end: torch.Tensor,
                     per_frame: int, delay: int, masked: bool) -> torch.Tensor:
    """`residual_unit` as a torch operator: torch.compile keeps it whole (one kernel inside the compiled step)."""
    return residual_unit(joined, x, x_history, alpha2, dw_weight, dw_bias, pw_weight, pw_bias, dilation, frame,
                         end, per_frame, delay, masked)


@residual_unit_op.register_fake
def _(joined: torch.Tensor, x: torch.Tensor, x_history: torch.Tensor, alpha2: torch.Tensor, dw_weight: torch.Tensor,
      dw_bias: torch.Tensor | None, pw_weight: torch.Tensor, pw_bias: torch.Tensor | None, dilation: int,
      frame: torch.Tensor, end: torch.Tensor, per_frame: int, delay: int, masked: bool) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- block heads ----------------------------------------------------------------------------------------------


def head_phases(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """A ConvTranspose1d weight [C_in, C_out, 2 s] as `block_head` reads it: [2, s * C_out, C_in] contiguous, row
    o * s + r of [0] the weights of the new input (W[:, o, r]), of [1] those of the input before it
    (W[:, o, r + s])."""
    c_in, c_out, taps = weight.shape
    if taps != 2 * stride:
        raise ValueError(f"block heads have kernels of twice the stride: {taps} taps, stride {stride}")
    return weight.reshape(c_in, c_out, 2, stride).permute(2, 1, 3, 0).reshape(2, c_out * stride, c_in).contiguous()


def head_tiles(in_channels: int, out_channels: int, stride: int, length: int,
               interpreted: bool = False) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_R, BLOCK_T, BLOCK_O, BLOCK_CI, num_warps, num_stages) of a block head of `length` new inputs a
    stream: up to 64 input columns of one stream a tile; short streams side by side up to 128 columns, 256 rows of
    (output channel, phase) and 16 warps; one stream a tile: up to 512 rows and 8 warps; input channels in blocks
    of 64: the fastest of the tiles measured per head (docs/decisions/snac-kernels.md, "Block heads").
    `interpreted` (Triton's interpreter, on a CPU): one tile per stream, big channel blocks (each op one numpy
    call over it, within Triton's bound on a tile's size)."""
    whole = _whole(length)
    if interpreted:
        return 1, whole, max(1, min(out_channels, 512 // stride)), min(in_channels, 256), 4, 1
    block_t, block_r = min(64, whole), max(1, 128 // whole)
    rows, warps = (256, 16) if block_r > 1 else (512, 8)
    return block_r, block_t, max(1, min(out_channels, rows // stride)), min(in_channels, 64), warps, 1


def block_head(x_history: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, phases: torch.Tensor,
               bias: torch.Tensor | None, stride: int,
               tiles: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """A decoder block's head for B streams: ConvTranspose1d(snake(inputs)) over `x_history` [B, C_in, 1] (the
    kept Snake output of the input before `x`) and `x` [B, C_in, L] the new inputs (both contiguous in time, any
    batch/channel strides), the outputs no later input reaches (`layers._ConvT.step`), bias added: [B, C_out, L s]
    contiguous, in x's dtype. `phases`: `head_phases` of the weight; `alpha`: the Snake's [C_in] (any shape);
    `tiles`: `head_tiles`' choice unless given."""
    batch, in_channels, length = x.shape
    out_channels = phases.shape[1] // stride
    if x_history.shape != (batch, in_channels, 1):
        raise ValueError(f"x_history is {tuple(x_history.shape)}, not {(batch, in_channels, 1)}")
    if phases.shape != (2, out_channels * stride, in_channels) or not phases.is_contiguous():
        raise ValueError(f"phases must be head_phases' contiguous [2, s * C_out, {in_channels}], not "
                         f"{tuple(phases.shape)}")
    if alpha.numel() != in_channels or (bias is not None and bias.numel() != out_channels):
        raise ValueError(f"alpha needs {in_channels} values and bias {out_channels}")
    if x.stride(-1) != 1:
        raise ValueError("x must be contiguous in time")
    block_r, block_t, block_o, block_ci, warps, stages = tiles or head_tiles(in_channels, out_channels, stride, length,
                                                                     interpreted=x.device.type == "cpu")
    if out_channels % block_o or in_channels % block_ci:
        raise ValueError(f"tiles {block_o} x {block_ci} do not divide {out_channels} x {in_channels} channels")
    out = torch.empty((batch, out_channels, length * stride), dtype=x.dtype, device=x.device)
    grid = (-(-batch // block_r), -(-length // block_t), out_channels // block_o)
    _head_kernel()[grid](
        x, x.stride(0), x.stride(1), x_history, x_history.stride(0), x_history.stride(1), out, out.stride(0),
        out.stride(1), alpha.reshape(-1), phases, phases if bias is None else bias, length, batch,
        C_IN=in_channels, C_OUT=out_channels, S=stride, HAS_BIAS=bias is not None,
        LOW_PRECISION=x.dtype != torch.float32, BLOCK_R=block_r, BLOCK_T=block_t, BLOCK_O=block_o,
        BLOCK_CI=block_ci, num_warps=warps, num_stages=stages)
    return out


@torch.library.custom_op("orpheus_gateway::snac_block_head", mutates_args=())
def block_head_op(x_history: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, phases: torch.Tensor,
                  bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    """`block_head` as a torch operator: torch.compile keeps it whole (one kernel inside the compiled step)."""
    return block_head(x_history, x, alpha, phases, bias, stride)


@block_head_op.register_fake
def _(x_history: torch.Tensor, x: torch.Tensor, alpha: torch.Tensor, phases: torch.Tensor,
      bias: torch.Tensor | None, stride: int) -> torch.Tensor:
    batch, _, length = x.shape
    return x.new_empty((batch, phases.shape[1] // stride, length * stride))
