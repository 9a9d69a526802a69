"""SNAC's block heads (Snake, then the ConvTranspose1d that upsamples, as the streaming step writes them) two ways,
for each of the four blocks at one batch: cuDNN's transposed convolution then the step's slice (today's step), and
the same outputs as one matrix product per block ("polyphase": output phase r of input t is W[:, :, r] x[t] +
W[:, :, r + s] x[t - 1] for a kernel of twice the stride), both through torch.compile:

    python tools/device/snac_head_variants.py --out head_variants.json --batch 256

Why: in a 256-stream step the transposed convolutions ran as cuDNN dgrad kernels wrapped in layout conversions
(nchw <-> nhwc), about 0.6-0.8 ms of the ~2.6 ms the fused units leave (docs/benchmarks.md, "SNAC alone: fused
residual units"). Per block: GPU ms of each variant (median of CUDA-event timings) and the largest difference of
the polyphase outputs from today's (float32 and the run's dtype). CPU smoke check (eager, float32):
`python tools/device/snac_head_variants.py --device cpu --batch 2 --out x.json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from snac.layers import snake
from torch.nn import functional as nnf

sys.path.insert(0, str(Path(__file__).parent))
from snac_unit_tiles import bench_parser, bench_setup, timed  # the unit sweep's options and timing

# SNAC 24 kHz's decoder blocks: (input channels, stride, new input samples per stream in a one-frame step).
BLOCKS = ((1024, 8, 4), (512, 8, 32), (256, 4, 256), (128, 2, 1024))


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


def stack_phases(weight: torch.Tensor, stride: int) -> torch.Tensor:
    """[C_in, C_out, 2 s] -> [s * C_out, 2 C_in]: row r * C_out + o is (W[:, o, r], W[:, o, r + s])."""
    first, second = weight[:, :, :stride], weight[:, :, stride:]
    return torch.cat([first, second], dim=0).permute(2, 1, 0).reshape(stride * weight.shape[1], -1).contiguous()


def bench_block(channels: int, stride: int, new: int, batch: int, device: torch.device, dtype: torch.dtype,
                repeats: int, compiled: bool) -> dict[str, Any]:
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
    args = [t.to(device=device, dtype=dtype) for t in (x, alpha, weight, bias)]
    stacked = stack_phases(args[2], stride)
    first = torch.compile(today, fullgraph=True) if compiled else today
    second = torch.compile(polyphase, fullgraph=True) if compiled else polyphase
    row["today_ms"] = round(timed(lambda: first(*args, stride), device, repeats), 4)
    row["polyphase_ms"] = round(timed(lambda: second(args[0], args[1], stacked, args[3], stride), device, repeats), 4)
    return row


def main(argv: list[str] | None = None) -> int:
    args = bench_parser(__doc__.split("\n\n")[0]).parse_args(argv)
    device, dtype, repeats, report = bench_setup(args, "blocks")
    for channels, stride, new in BLOCKS:
        row = bench_block(channels, stride, new, args.batch, device, dtype, repeats, device.type == "cuda")
        report["blocks"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=1))  # a lease can end mid-run: keep what is done
    totals = {k: round(sum(r[k] for r in report["blocks"]), 4) for k in ("today_ms", "polyphase_ms")}
    report["totals_ms"] = totals
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'C_in':>5} {'s':>2} {'T':>5} {'today_ms':>9} {'polyphase_ms':>13} {'diff f32':>9}")
    for r in report["blocks"]:
        print(f"{r['channels']:>5} {r['stride']:>2} {r['new_samples']:>5} {r['today_ms']:>9.4f} "
              f"{r['polyphase_ms']:>13.4f} {r['max_abs_diff_float32']:>9.2e}")
    print(f"four block heads: today {totals['today_ms']} ms, polyphase {totals['polyphase_ms']} ms, batch {args.batch}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
