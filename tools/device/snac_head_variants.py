"""SNAC's block heads (Snake, then the ConvTranspose1d that upsamples, as the streaming step writes them) three
ways, for each of the four blocks at one batch: cuDNN's transposed convolution then the step's slice (today's
step), the same outputs as one matrix product per block ("polyphase": output phase r of input t is W[:, :, r] x[t]
+ W[:, :, r + s] x[t - 1] for a kernel of twice the stride), both through torch.compile, and the fused Triton
kernel (`triton`: `gateway.speech.snac.kernels.block_head`, the Snake in its loads, in `head_tiles`' choice;
`--sweep` also times a grid of tiles and reports the fastest):

    python tools/device/snac_head_variants.py --out head_variants.json --batch 256

Why: in a 256-stream step the transposed convolutions ran as cuDNN dgrad kernels wrapped in layout conversions
(nchw <-> nhwc), about 0.6-0.8 ms of the ~2.6 ms the fused units leave (docs/benchmarks.md, "SNAC alone: fused
residual units"). Per block: GPU ms of each variant (median of CUDA-event timings) and the largest difference of
the polyphase and triton outputs from today's (float32 and the run's dtype). CPU smoke check (eager, float32; the
triton variant only under Triton's interpreter, `TRITON_INTERPRET=1`):
`python tools/device/snac_head_variants.py --device cpu --batch 2 --out x.json`.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from snac.layers import snake
from torch.nn import functional as nnf

sys.path.insert(0, str(Path(__file__).parent))
from snac_unit_tiles import bench_parser, bench_setup, timed  # the unit sweep's options and timing

from gateway.speech.snac.kernels import block_head, head_phases, head_tiles

# SNAC 24 kHz's decoder blocks: (input channels, stride, new input samples per stream in a one-frame step).
BLOCKS = ((1024, 8, 4), (512, 8, 32), (256, 4, 256), (128, 2, 1024))
# --sweep: input columns a tile (streams x samples), rows of (output channel, phase), warps, pipeline stages (3
# compiled with the registers and shared memory of 1: not swept, snac_kernel_resources.py). The first sweep's
# fastest tiles were at its largest columns and rows (128, 256) and 8 warps, so this one reaches past them.
SWEEP = ((64, 128, 256), (128, 256, 512), (8, 16), (1,))
BLOCK_CI = 64  # input channels a step of the products' loop
Tiles = tuple[int, int, int, int, int, int]


def today(x: torch.Tensor, alpha: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, stride: int) -> torch.Tensor:
    """`layers._ConvT.step` after the block's Snake: x holds one kept input, then the new ones."""
    new = x.shape[-1] - 1
    return nnf.conv_transpose1d(snake(x, alpha), weight, bias, stride=stride)[..., stride:(1 + new) * stride]


def polyphase(x: torch.Tensor, alpha: torch.Tensor, stacked: torch.Tensor, bias: torch.Tensor,
              stride: int) -> torch.Tensor:
    """The same outputs as one product: `stacked` [stride * C_out, 2 * C_in] holds W[:, :, r] beside
    W[:, :, r + stride] for each phase r; the inputs stack each new sample over the one before it."""
    s = snake(x, alpha)
    pairs = torch.cat([s[..., 1:], s[..., :-1]], dim=1)  # [B, 2 C_in, T]
    y = torch.matmul(stacked, pairs)  # [B, stride * C_out, T]
    batch, _, length = y.shape
    y = y.view(batch, stride, -1, length).permute(0, 2, 3, 1).reshape(batch, -1, length * stride)
    return y + bias[:, None]


def fused(x: torch.Tensor, alpha: torch.Tensor, phases: torch.Tensor, bias: torch.Tensor, stride: int,
          tiles: Tiles | None = None) -> torch.Tensor:
    """The Triton kernel on the same inputs. The kept input's Snake, which the step keeps in its state, is computed
    here, inside the timing: one small elementwise op on [B, C, 1]."""
    return block_head(snake(x[..., :1], alpha), x[..., 1:], alpha, phases, bias, stride, tiles=tiles)


def sweep_tiles(channels: int, stride: int, new: int) -> list[Tiles]:
    """Every tile of `SWEEP` that fits the block's shape."""
    whole = 1 << (new - 1).bit_length()
    tiles = []
    for columns, rows, warps, stages in itertools.product(*SWEEP):
        block_t = min(columns, whole)
        block_o = min(channels // 2, max(1, rows // stride))
        tiles.append((max(1, columns // block_t), block_t, block_o, min(channels, BLOCK_CI), warps, stages))
    return sorted(set(tiles))


def stack_phases(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """[C_in, C_out, 2 s] -> [s * C_out, 2 C_in]: row r * C_out + o is (W[:, o, r], W[:, o, r + s])."""
    first, second = weight[:, :, :stride], weight[:, :, stride:]
    return torch.cat([first, second], dim=0).permute(2, 1, 0).reshape(stride * weight.shape[1], -1).contiguous()


def bench_block(channels: int, stride: int, new: int, batch: int, device: torch.device, dtype: torch.dtype,
                repeats: int, compiled: bool, triton: bool, sweep: bool) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(channels + stride)
    out_channels = channels // 2
    weight = torch.randn(channels, out_channels, 2 * stride, generator=g) * channels ** -0.5
    bias, alpha = torch.randn(out_channels, generator=g), torch.rand(1, channels, 1, generator=g) + 0.5
    x = torch.randn(batch, channels, new + 1, generator=g)
    row: dict[str, Any] = {"channels": channels, "stride": stride, "new_samples": new}
    for name, dt in (("float32", torch.float32), (str(dtype).removeprefix("torch."), dtype)):
        args = [t.to(device=device, dtype=dt) for t in (x, alpha, weight, bias)]
        want = today(*args, stride)
        got = polyphase(args[0], args[1], stack_phases(args[2], stride), args[3], stride)
        row[f"max_abs_diff_{name}"] = float((got.float() - want.float()).abs().max())
        if triton:
            got = fused(args[0], args[1], head_phases(args[2], stride), args[3], stride)
            row[f"triton_max_abs_diff_{name}"] = float((got.float() - want.float()).abs().max())
    args = [t.to(device=device, dtype=dtype) for t in (x, alpha, weight, bias)]
    stacked = stack_phases(args[2], stride)
    first = torch.compile(today, fullgraph=True) if compiled else today
    second = torch.compile(polyphase, fullgraph=True) if compiled else polyphase
    row["today_ms"] = round(timed(lambda: first(*args, stride), device, repeats), 4)
    row["polyphase_ms"] = round(timed(lambda: second(args[0], args[1], stacked, args[3], stride), device, repeats), 4)
    if triton:
        phases = head_phases(args[2], stride)
        row["triton_tiles"] = head_tiles(channels, channels // 2, stride, new, interpreted=device.type == "cpu")
        row["triton_ms"] = round(timed(lambda: fused(args[0], args[1], phases, args[3], stride), device, repeats), 4)
        if sweep:
            swept = {}
            for tiles in sweep_tiles(channels, stride, new):
                try:
                    swept[tiles] = timed(lambda t=tiles: fused(args[0], args[1], phases, args[3], stride, t),
                                         device, repeats)
                except Exception as exc:  # a tile that does not fit the card (shared memory, registers)
                    print(f"tiles {tiles}: {type(exc).__name__}", flush=True)
            best = min(swept, key=swept.__getitem__)
            row["triton_best_tiles"], row["triton_best_ms"] = best, round(swept[best], 4)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="also time every tile of SWEEP for the triton variant")
    args = parser.parse_args(argv)
    device, dtype, repeats, report = bench_setup(args, "blocks")
    cuda = device.type == "cuda"
    triton = cuda or os.environ.get("TRITON_INTERPRET") == "1"  # a CPU runs the kernel only interpreted
    variants = ("today_ms", "polyphase_ms") + ("triton_ms",) * triton
    for channels, stride, new in BLOCKS:
        row = bench_block(channels, stride, new, args.batch, device, dtype, repeats, cuda, triton, args.sweep)
        report["blocks"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=1))  # a lease can end mid-run: keep what is done
    totals = {k: round(sum(r[k] for r in report["blocks"]), 4) for k in variants}
    report["totals_ms"] = totals
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'C_in':>5} {'s':>2} {'T':>5} " + " ".join(f"{k:>12}" for k in variants)
          + f" {'diff f32':>9} {'triton f32':>10}")
    for r in report["blocks"]:
        triton_diff = f"{r['triton_max_abs_diff_float32']:.2e}" if triton else "-"
        print(f"{r['channels']:>5} {r['stride']:>2} {r['new_samples']:>5} "
              + " ".join(f"{r[k]:>12.4f}" for k in variants)
              + f" {r['max_abs_diff_float32']:>9.2e} {triton_diff:>10}")
    print("four block heads: " + ", ".join(f"{k.removesuffix('_ms')} {v} ms" for k, v in totals.items())
          + f", batch {args.batch}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
