"""The roofline of SNAC's streaming step, layer by layer: what each layer of a B-stream, one-frame step costs in
arithmetic and memory traffic per second of audio, how long it takes alone on this device, and the least time the
device's peak rates allow it.

    python -m gateway.benchmarks.snac_roofline --batch 384 --peak-tflops 989 --peak-tbps 3.35 --out r.json  # GPU
    python -m gateway.benchmarks.snac_roofline --device cpu --batch 4 --reps 2 --out r.json      # smoke check

Each layer runs alone on inputs of its shape in the step (one frame per stream, with its kept history), in the
decoder's dtype, eagerly (the kernels PyTorch picks for it); on CUDA `--reps` calls are captured in one graph and
replayed, so a figure is the layer's GPU time without launch overhead. Bytes are the layer's own traffic, read
once and written once (inputs with their history, outputs, weights); FLOPs count what the kernel computes (a
transposed convolution's step computes its kept inputs' outputs too). The limit is the larger of FLOPs / peak
FLOP rate and bytes / peak bandwidth (`--peak-tflops`, `--peak-tbps`: the card's data sheet, dense, in the dtype).
The "fused" line is the traffic left if every elementwise layer (Snake, noise, residual adds, masks) were folded
into the convolutions' loads and stores: the floor for kernels that fuse them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from gateway.devtools.devmodels import SNAC_24KHZ_CONFIG
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME
from gateway.speech.snac import DTYPES
from gateway.speech.snac.layers import LATENT_PER_FRAME, DecoderLayers

ELEMENTWISE_FLOPS = {"snake": 6, "noise": 4, "add": 1, "tanh": 1}  # per element: Snake is x + sin(a x)^2 / a
FRAMES_PER_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME


@dataclass
class Layer:
    """One layer of the step: what it computes and moves per step of B streams, and its time alone."""

    name: str
    kind: str  # conv, conv-depthwise, conv-transposed, snake, noise, add, tanh
    shape: str  # [B, C_in, T_in] -> [B, C_out, T_out]
    flops: float
    bytes: float
    step_us: float = 0.0

    def per_audio_second(self, batch: int) -> tuple[float, float]:
        """(GFLOP, MB) per second of one stream's audio."""
        scale = FRAMES_PER_SECOND / batch
        return self.flops * scale / 1e9, self.bytes * scale / 1e6


def _time_us(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Time of one call of `fn`: on CUDA, `reps` calls captured in one graph (no launch overhead), else eager."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - started) / reps * 1e6
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        fn()  # allocations happen outside the capture
        torch.cuda.synchronize(device)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end) * 1e3 / reps)
    return best


class Roofline:
    """Builds each layer's inputs in the step's shapes and times it alone."""

    def __init__(self, decoder: DecoderLayers, batch: int, device: torch.device, dtype: torch.dtype,
                 reps: int) -> None:
        self.decoder, self.batch, self.device, self.dtype, self.reps = decoder, batch, device, dtype, reps
        self.size = torch.finfo(dtype).bits // 8
        self.layers: list[Layer] = []

    def _input(self, channels: int, length: int) -> torch.Tensor:
        return torch.randn(self.batch, channels, length, device=self.device, dtype=self.dtype)

    def _add(self, name: str, kind: str, shape: str, flops: float, nbytes: float, fn: Callable[[], Any]) -> None:
        with torch.no_grad():
            step_us = _time_us(fn, self.device, self.reps)
        self.layers.append(Layer(name, kind, shape, flops, nbytes, step_us))

    def elementwise(self, name: str, kind: str, channels: int, length: int, fn: Callable[[torch.Tensor], Any],
                    operands: int = 1) -> None:
        x = self._input(channels, length)
        count = self.batch * channels * length
        self._add(name, kind, f"[B, {channels}, {length}]", ELEMENTWISE_FLOPS[kind] * count,
                  (operands + 1) * count * self.size, lambda: fn(x))

    def conv(self, name: str, conv: Any, length: int) -> int:
        """A stride-1 convolution producing `length` samples from `length + history` inputs."""
        c_out, c_in_per_group, k = conv.weight.shape
        c_in = c_in_per_group * conv.groups
        x = self._input(c_in, length + conv.history)
        flops = 2.0 * self.batch * c_out * length * c_in_per_group * k
        nbytes = (x.numel() + self.batch * c_out * length + conv.weight.numel()) * self.size
        kind = "conv-depthwise" if conv.groups > 1 else "conv"
        self._add(name, kind, f"[B, {c_in}, {length}+{conv.history}] -> [B, {c_out}, {length}]", flops, nbytes,
                  lambda: conv.valid(x))
        return c_out

    def conv_transposed(self, name: str, up: Any, length: int) -> int:
        c_in, c_out, k = up.weight.shape
        x = self._input(c_in, length + up.history)
        flops = 2.0 * self.batch * c_in * c_out * k * (length + up.history)
        nbytes = (x.numel() + self.batch * c_out * length * up.stride + up.weight.numel()) * self.size
        self._add(name, "conv-transposed", f"[B, {c_in}, {length}+{up.history}] -> [B, {c_out}, "
                  f"{length * up.stride}]", flops, nbytes, lambda: up.step(x))
        return c_out

    def run(self) -> list[Layer]:
        d = self.decoder
        length = LATENT_PER_FRAME  # one frame per stream per step
        channels = d.tables[0].shape[1]
        for i, conv in enumerate(d.pre):
            channels = self.conv(f"pre{i}", conv, length)
        for bi, block in enumerate(d.blocks):
            self.elementwise(f"b{bi}.snake", "snake", channels, length + block.up.history, block.snake)
            channels = self.conv_transposed(f"b{bi}.up", block.up, length)
            length *= block.up.stride
            if block.noise is not None:
                self.conv(f"b{bi}.noise.linear", block.noise, length)
                self.elementwise(f"b{bi}.noise.add", "noise", channels, length, lambda x: x + x * x, operands=2)
            for ui, unit in enumerate(block.units):
                tag = f"b{bi}.u{ui}"
                self.elementwise(f"{tag}.snake1", "snake", channels, length + unit.conv.history, unit.snake1)
                self.conv(f"{tag}.conv", unit.conv, length)
                self.elementwise(f"{tag}.snake2", "snake", channels, length, unit.snake2)
                self.conv(f"{tag}.proj", unit.proj, length)
                self.elementwise(f"{tag}.add", "add", channels, length, lambda x: x + x, operands=2)
        self.elementwise("final.snake", "snake", channels, length + d.final.history, d.final_snake)
        self.conv("final.conv", d.final, length)
        self.elementwise("final.tanh", "tanh", 1, length, torch.tanh)
        return self.layers


def summarise(layers: list[Layer], batch: int, peak_flops: float | None, peak_bw: float | None) -> dict[str, Any]:
    rows = []
    for layer in layers:
        gflop, mbytes = layer.per_audio_second(batch)
        limit_us = None
        bound = None
        if peak_flops and peak_bw:
            compute_us, memory_us = layer.flops / peak_flops * 1e6, layer.bytes / peak_bw * 1e6
            limit_us, bound = max(compute_us, memory_us), ("compute" if compute_us > memory_us else "memory")
        rows.append({**asdict(layer), "gflop_per_audio_s": gflop, "mb_per_audio_s": mbytes, "limit_us": limit_us,
                     "bound": bound})
    total_us = sum(r["step_us"] for r in rows)
    fused_bytes = sum(layer.bytes for layer in layers if layer.kind.startswith("conv"))
    totals: dict[str, Any] = {
        "step_us": total_us,
        "device_ms_per_audio_s": total_us / 1e3 * FRAMES_PER_SECOND / batch,
        "gflop_per_audio_s": sum(r["gflop_per_audio_s"] for r in rows),
        "mb_per_audio_s": sum(r["mb_per_audio_s"] for r in rows),
        "fused_mb_per_audio_s": fused_bytes * FRAMES_PER_SECOND / batch / 1e6,
    }
    if peak_flops and peak_bw:
        totals["limit_us"] = sum(r["limit_us"] for r in rows)
        fused_limit = sum(max(layer.flops / peak_flops, layer.bytes / peak_bw) for layer in layers
                          if layer.kind.startswith("conv"))
        totals["fused_limit_us"] = fused_limit * 1e6
    by_kind: dict[str, dict[str, float]] = {}
    for r in rows:
        kind = by_kind.setdefault(r["kind"], {"step_us": 0.0, "gflop_per_audio_s": 0.0, "mb_per_audio_s": 0.0,
                                              "limit_us": 0.0})
        for key in kind:
            kind[key] += r[key] or 0.0
    return {"layers": rows, "by_kind": by_kind, "totals": totals}


def table(result: dict[str, Any]) -> str:
    lines = ["| layer | kind | shape | GFLOP / audio s | MB / audio s | µs alone | limit µs | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["layers"]:
        limit = "-" if r["limit_us"] is None else f"{r['limit_us']:.2f}"
        lines.append(f"| {r['name']} | {r['kind']} | {r['shape']} | {r['gflop_per_audio_s']:.3f} | "
                     f"{r['mb_per_audio_s']:.2f} | {r['step_us']:.1f} | {limit} | {r['bound'] or '-'} |")
    lines += ["", "| kind | µs alone | limit µs | GFLOP / audio s | MB / audio s |", "|---|---|---|---|---|"]
    for kind, v in sorted(result["by_kind"].items(), key=lambda kv: -kv[1]["step_us"]):
        lines.append(f"| {kind} | {v['step_us']:.1f} | {v['limit_us']:.2f} | {v['gflop_per_audio_s']:.3f} | "
                     f"{v['mb_per_audio_s']:.2f} |")
    t = result["totals"]
    lines += ["", f"step alone, summed: {t['step_us']:.1f} µs = {t['device_ms_per_audio_s']:.4f} device ms per audio "
                  f"second; {t['gflop_per_audio_s']:.2f} GFLOP and {t['mb_per_audio_s']:.1f} MB per audio second "
                  f"({t['fused_mb_per_audio_s']:.1f} MB if the elementwise layers were fused)"]
    if "limit_us" in t:
        lines.append(f"limit: {t['limit_us']:.1f} µs unfused, {t['fused_limit_us']:.1f} µs fused")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m gateway.benchmarks.snac_roofline",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=384, help="streams in the step")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--reps", type=int, default=20, help="calls per timing (one CUDA graph on a GPU)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense FLOP rate in this dtype, TFLOP/s "
                        "(without both peaks: no limit columns)")
    parser.add_argument("--peak-tbps", type=float, help="the device's memory bandwidth, TB/s")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from snac import SNAC

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    torch.manual_seed(0)
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    decoder = DecoderLayers(model, device, dtype)
    layers = Roofline(decoder, args.batch, device, dtype, args.reps).run()
    peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else None
    peak_bw = args.peak_tbps * 1e12 if args.peak_tbps else None
    result = summarise(layers, args.batch, peak_flops, peak_bw)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    result.update(device=name, batch=args.batch, dtype=args.dtype, reps=args.reps, peak_flops=peak_flops,
                  peak_bandwidth=peak_bw, torch=torch.__version__)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"SNAC step roofline, {name}, {args.batch} streams, {args.dtype}\n\n{table(result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
