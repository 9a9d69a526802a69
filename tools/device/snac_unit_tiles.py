"""The fused residual-unit kernel (`gateway.speech.snac.kernels.residual_unit`) in a grid of tile shapes, against the
same unit compiled by torch.compile the way the step writes it (depthwise taps as shifted products, Snake, the 1x1
projection, the delayed skip), for each of SNAC's twelve unit shapes at one batch:

    python tools/device/snac_unit_tiles.py --out unit_tiles.json --batch 256

Per shape (channels, samples per step, dilation): GPU ms of the compiled unit, of the kernel in `unit_tiles`'
choice, and of the fastest tiles found (BLOCK_R, BLOCK_T, BLOCK_CO, BLOCK_CI, warps; every tile of `tile_grid` at
dilation 1, its best at 3 and 9), median of CUDA-event timings; tiles that do not fit the card are skipped. The sum
over the twelve shapes is what the units cost a step each way; the fastest tiles per shape are what `unit_tiles`
should return. Every timed kernel output is compared with the compiled unit's (max abs difference, bfloat16).
CPU smoke check of the script (Triton's interpreter, float32, one
config): `TRITON_INTERPRET=1 python tools/device/snac_unit_tiles.py --device cpu --batch 1 --quick --out x.json`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from snac.layers import snake
from torch.nn import functional as nnf

from gateway.speech.snac.kernels import TAPS, residual_unit, tile_warps, unit_tiles

# SNAC 24 kHz's decoder blocks: (channels, samples per stream in a one-frame step); each has units of dilation 1, 3, 9.
UNIT_SHAPES = ((512, 32), (256, 256), (128, 1024), (64, 2048))
DILATIONS = (1, 3, 9)
COLUMNS = (64, 128)  # streams x samples side by side in a tile
BLOCK_CO = (64, 128, 256)
BLOCK_CI = (32, 64)
Tiles = tuple[int, int, int, int, int]


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = 3) -> float:
    """Median ms of `fn` (CUDA events on a GPU, wall time elsewhere)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def layered_unit(joined: torch.Tensor, x: torch.Tensor, x_old: torch.Tensor, alpha2: torch.Tensor,
                 dw_w: torch.Tensor, dw_b: torch.Tensor, pw_w: torch.Tensor, pw_b: torch.Tensor,
                 dilation: int) -> torch.Tensor:
    """The unit after snake1 as the compiled step writes it (`layers._Conv.valid` with taps, `add_delayed`)."""
    length = x.shape[-1]
    h = joined[..., :length] * dw_w[:, :, 0]
    for tap in range(1, TAPS):
        at = tap * dilation
        h = h + joined[..., at:at + length] * dw_w[:, :, tap]
    h = snake(h + dw_b[:, None], alpha2)
    y = nnf.conv1d(h, pw_w, pw_b)
    return y + torch.cat([x_old, x[..., :length - x_old.shape[-1]]], dim=2)


def tile_grid(channels: int, length: int, quick: bool) -> list[Tiles]:
    """The tiles tried for a unit shape: 64 or 128 columns (one stream's samples, or several short streams side by
    side), output and input channel blocks; `tile_warps`' warps, and 16 beside 8 from 16384 outputs
    (8 warps spill registers there: snac_kernel_resources.py)."""
    if quick:
        return [unit_tiles(channels, length)]
    whole = 1 << (max(16, length) - 1).bit_length()
    grid = []
    for columns, co, ci in itertools.product(COLUMNS, BLOCK_CO, BLOCK_CI):
        block_t = min(columns, whole)
        if co <= channels and ci <= channels:
            grid.append((columns // block_t, block_t, co, ci, tile_warps(co * columns)))
            if co * columns >= 16384:
                grid.append((columns // block_t, block_t, co, ci, 16))
    return list(dict.fromkeys(grid))


def bench_shape(channels: int, length: int, dilation: int, batch: int, device: torch.device, dtype: torch.dtype,
                repeats: int, grid: list[Tiles], compiled: bool) -> dict[str, Any]:
    g = torch.Generator(device="cpu").manual_seed(channels * 31 + dilation)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)

    pad = (TAPS - 1) // 2 * dilation
    joined, x = rand(batch, channels, 2 * pad + length), rand(batch, channels, length)
    x_old = rand(batch, channels, pad)
    alpha2 = (torch.rand(1, channels, 1, generator=g) + 0.5).to(device=device, dtype=dtype)
    dw_w, dw_b = rand(channels, 1, TAPS, scale=0.3), rand(channels)
    pw_w, pw_b = rand(channels, channels, 1, scale=channels ** -0.5), rand(channels)
    frame = torch.full((batch,), 10, dtype=torch.int64, device=device)
    end = torch.full((batch,), 1 << 40, dtype=torch.int64, device=device)
    unit = torch.compile(layered_unit, fullgraph=True) if compiled else layered_unit
    args = (joined, x, x_old, alpha2, dw_w, dw_b, pw_w, pw_b, dilation)
    want = unit(*args)
    row: dict[str, Any] = {"channels": channels, "length": length, "dilation": dilation,
                           "compiled_ms" if compiled else "eager_ms": round(timed(lambda: unit(*args), device,
                                                                                  repeats), 4)}
    default = unit_tiles(channels, length)
    timings: dict[Tiles, float] = {}
    worst_diff = 0.0
    for tiles in dict.fromkeys([default, *grid]):
        def run(tiles: Tiles = tiles) -> torch.Tensor:
            return residual_unit(joined, x, x_old, alpha2, dw_w, dw_b, pw_w, pw_b, dilation, frame, end, length,
                                 0, False, tiles=tiles)
        try:
            got = run()
        except Exception as exc:  # a tile that does not fit the card (shared memory, registers)
            row.setdefault("skipped", []).append(f"{tiles}: {type(exc).__name__}")
            continue
        worst_diff = max(worst_diff, float((got.float() - want.float()).abs().max()))
        timings[tiles] = timed(run, device, repeats)
    best = min(timings, key=timings.__getitem__)
    row.update(default_tiles=list(default), default_ms=round(timings.get(default, float("nan")), 4),
               best_tiles=list(best), best_ms=round(timings[best], 4), max_abs_diff=worst_diff,
               tried=len(timings))
    return row


def bench_parser(description: str) -> argparse.ArgumentParser:
    """The options of every SNAC micro-benchmark here: --out, --device, --batch, --repeats."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256, help="streams per step")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 20 on CUDA, 1 on CPU)")
    return parser


def bench_setup(args: argparse.Namespace, rows: str) -> tuple[torch.device, torch.dtype, int, dict[str, Any]]:
    """The device, its dtype (bfloat16 on CUDA, float32 elsewhere), the timed calls, and the report's header
    with an empty list of `rows`."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if cuda else "cpu",
                              "torch": torch.__version__, "batch": args.batch, "dtype": str(dtype), rows: []}
    return device, dtype, args.repeats or (20 if cuda else 1), report


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only unit_tiles' choice (a smoke check)")
    args = parser.parse_args(argv)
    device, dtype, repeats, report = bench_setup(args, "units")
    cuda = device.type == "cuda"
    best: dict[tuple[int, int], Tiles] = {}
    for (channels, length), dilation in itertools.product(UNIT_SHAPES, DILATIONS):
        # every tile at dilation 1; the other dilations (only their loads' offsets differ) try that one's best
        grid = tile_grid(channels, length, args.quick) if dilation == 1 else [best[channels, length]]
        row = bench_shape(channels, length, dilation, args.batch, device, dtype, repeats, grid, compiled=cuda)
        best.setdefault((channels, length), tuple(row["best_tiles"]))
        report["units"].append(row)
        print(json.dumps(row), flush=True)
        args.out.write_text(json.dumps(report, indent=1))  # a lease can end mid-run: keep what is done
    reference = "compiled_ms" if cuda else "eager_ms"
    totals = {name: round(sum(r[name] for r in report["units"]), 3) for name in (reference, "default_ms", "best_ms")}
    report["totals_ms"] = totals
    args.out.write_text(json.dumps(report, indent=1))
    print(f"{'C':>4} {'L':>5} {'d':>2} {reference:>12} {'default_ms':>11} {'best_ms':>8}  best tiles")
    for r in report["units"]:
        print(f"{r['channels']:>4} {r['length']:>5} {r['dilation']:>2} {r[reference]:>12.4f} {r['default_ms']:>11.4f} "
              f"{r['best_ms']:>8.4f}  {r['best_tiles']}")
    print(f"twelve units: {reference} {totals[reference]} ms, kernel (unit_tiles) {totals['default_ms']} ms, "
          f"kernel (best tiles) {totals['best_ms']} ms, batch {args.batch}")
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
