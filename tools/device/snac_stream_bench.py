"""GPU cost of SNAC decoding per stream: the old 3-frame windows vs the exact streaming decoder.

For each batch size B (streams decoded together) and dtype, one call advances every stream by one Orpheus frame
(2048 samples, 85.3 ms of audio):

- windows: `windows_baseline.SnacModel` with CUDA graphs on 3-frame windows (1 context + 1 new + 1
  lookahead), what the gateway ran before the exact stream (the baseline);
- stream: `gateway.speech.snac.StreamingSnac` with CUDA graphs (one frame per stream per step);
- stream-compiled (`--stream-variants eager,compiled`): the same with its step through torch.compile;
- stream-kernels (`kernels`): compiled, its residual units as the fused Triton kernels (`snac.kernels`), the
  block heads still cuDNN's; `kernels-eager`: the units' kernels without torch.compile around them;
  `kernels-heads`: compiled, with the fused residual units and the fused block heads (`snac.kernels.block_head`),
  the gateway's `--snac-kernels` (docs/decisions/snac-kernels.md, "Block heads").

Reported per row: `gpu_ms` (torch.cuda.Event time of the graph replay alone, median; for the stream the
unmasked steady-state step, `gpu_ms_masked` the masked step of a stream's first 3 and last 3 steps), `call_ms`
(the whole host call as the gateway makes it: input copy, replay, PCM copy back; wall time, median), and
`gpu_ms_per_audio_s` = GPU ms per second of audio per stream = gpu_ms / B * 24000 / 2048. The streaming
decoder also runs ceil(4757 / 2048) = 3 flush steps per utterance: `amortized_gpu_ms_per_audio_s` adds them
(and the masked steps) for utterances of `--utterance-frames` frames; `win/str` is the windows' cost over the
stream's, both amortized. Before timing, `check` compares the graphed streaming decode of a few utterances
(lengths 1, 7, 23, in one padded batch) with `snac.SNAC.decode` of the same codes and noise (TF32 off for
that comparison only) and the bfloat16 stream with the float32 one. `bridge` times the fast start's bridge
decode (3 frames, B = 1..64) replayed from its graph against eager, as whole host calls.

Weights: a random-weight SNAC with the real 24 kHz config (`build_test_snac`); the cost does not depend on the
weights. GPU: `python tools/device/snac_stream_bench.py --out OUT.json`. CPU smoke check (eager, wall-clock
timing): `python tools/device/snac_stream_bench.py --device cpu --batches 4,16 --out OUT.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from windows_baseline import SnacModel  # tools/device/ is the script's own folder, first on sys.path

from gateway.devtools.devmodels import build_test_snac
from gateway.devtools.snac_reference import reference_decode
from gateway.orpheus import SAMPLE_RATE, SAMPLES_PER_FRAME, SLOTS_PER_FRAME
from gateway.speech.snac import OPEN_END, StreamingSnac

WINDOW_FRAMES = 3
# --stream-variants: (torch.compile, fused residual-unit kernels, fused block-head kernels) of the streaming step
VARIANTS = {"eager": (False, False, False), "compiled": (True, False, False), "kernels": (True, True, False),
            "kernels-eager": (False, True, False), "kernels-heads": (True, True, True)}
STEPS_PER_AUDIO_SECOND = SAMPLE_RATE / SAMPLES_PER_FRAME  # 11.72 calls per second of audio per stream


def timed(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int) -> tuple[float, float]:
    """(median GPU ms by CUDA events, median wall ms) of `fn`; on CPU both are wall time."""
    for _ in range(warmup):
        fn()
    gpu: list[float] = []
    wall: list[float] = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            end.synchronize()
            wall.append((time.perf_counter() - t0) * 1000)
            gpu.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            wall.append((time.perf_counter() - t0) * 1000)
            gpu.append(wall[-1])
    return statistics.median(gpu), statistics.median(wall)


def _snake_eager(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    shape = x.shape
    x = x.reshape(shape[0], shape[1], -1)
    x = x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)
    return x.reshape(shape)


def use_compiled_snake() -> None:
    """Replace snac's Snake (several elementwise kernels, each a full pass over memory) by one Inductor kernel,
    in snac itself (the windows decoder) and in the streaming decoder. Dynamic shapes: one compile for all."""
    import snac.layers
    import torch._dynamo

    import gateway.speech.snac.layers as stream

    # One graph per (dtype, batch 1 or more, channel count) at most: a few dozen small compiles.
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.accumulated_recompile_limit = 1024
    compiled = torch.compile(_snake_eager, dynamic=True, fullgraph=True)
    snac.layers.snake = compiled
    stream.snake = compiled


def bench_windows(snac_dir: str, device: torch.device, dtype: str, batches: list[int], repeats: int,
                  warmup: int) -> list[dict[str, Any]]:
    model = SnacModel.load(snac_dir, str(device), dtype)
    t0 = time.perf_counter()
    model.capture_graphs([WINDOW_FRAMES], max(batches))
    capture_s = time.perf_counter() - t0
    rows = []
    rng = np.random.default_rng(0)
    for batch in batches:
        codes = rng.integers(0, 4096, (batch, SLOTS_PER_FRAME * WINDOW_FRAMES), dtype=np.int64)
        graphed = model.graphed(WINDOW_FRAMES, batch)
        if graphed is not None and batch in graphed._graphs:
            graph, static_codes, _ = graphed._graphs[batch]
            static_codes.copy_(torch.from_numpy(codes))
            gpu_ms, _ = timed(graph.replay, device, repeats, warmup)
        else:
            gpu_ms, _ = timed(lambda c=codes: model.decode_codes(c, WINDOW_FRAMES), device, repeats, warmup)
        _, call_ms = timed(lambda c=codes: model.decode_codes(c, WINDOW_FRAMES), device, repeats, warmup)
        per_s = gpu_ms / batch * STEPS_PER_AUDIO_SECOND
        rows.append({"method": "windows", "dtype": dtype, "batch": batch, "gpu_ms": round(gpu_ms, 3),
                     "call_ms": round(call_ms, 3), "gpu_ms_per_audio_s": round(per_s, 4),
                     "decoded_frames_per_new_frame": float(WINDOW_FRAMES),
                     "amortized_gpu_ms_per_audio_s": round(per_s, 4), "graphed": graphed is not None,
                     "capture_s": round(capture_s, 2)})
    return rows


def bench_stream(snac_dir: str, device: torch.device, dtype: str, batches: list[int], repeats: int,
                 warmup: int, utterance_frames: int, variant: str = "eager") -> list[dict[str, Any]]:
    t0 = time.perf_counter()
    compile, kernels, heads = VARIANTS[variant]
    snac = StreamingSnac.load(snac_dir, str(device), dtype, max_streams=max(batches), max_batch=max(batches),
                              compile=compile, kernels=kernels, head_kernels=heads)
    capture_s = time.perf_counter() - t0
    rows = []
    rng = np.random.default_rng(1)
    flush = -(-snac.delay_samples // SAMPLES_PER_FRAME)  # 3 flush steps, and 3 start steps, run masked
    edge_steps = min(utterance_frames + flush, 2 * flush)
    for batch in batches:
        handles = [snac.open_stream(seed) for seed in range(batch)]
        for h in handles:
            snac.push(h, [tuple(int(c) for c in rng.integers(0, 4096, 7)) for _ in range(repeats + warmup + 8)])
        # Replay alone: one mid-utterance step, the inputs as step_batch packs them, replayed in place.
        packed = torch.tensor([[*([0] * SLOTS_PER_FRAME), h.slot, 10, OPEN_END, h.seed] for h in handles],
                              dtype=torch.int64, device=device)
        gpu_ms = {}
        for masked in (False, True):
            graph = snac._graphs.get((masked, batch))
            if graph is not None:
                graph.inputs.copy_(packed)
                gpu_ms[masked], _ = timed(graph.graph.replay, device, repeats, warmup)
            else:
                gpu_ms[masked], _ = timed(lambda p=packed, m=masked: snac._launch(p, m), device, repeats, warmup)
        for _ in range(4):  # past the 3 masked start steps: step_batch then runs the unmasked graph
            snac.step_batch(handles)
        _, call_ms = timed(lambda hs=handles: snac.step_batch(hs), device, repeats, warmup)
        for h in handles:
            snac.close(h)
        per_s = gpu_ms[False] / batch * STEPS_PER_AUDIO_SECOND
        masked_per_s = gpu_ms[True] / batch * STEPS_PER_AUDIO_SECOND
        steps = utterance_frames + flush
        amortized = ((steps - edge_steps) * per_s + edge_steps * masked_per_s) / utterance_frames
        rows.append({"method": "stream" if variant == "eager" else f"stream-{variant}", "dtype": dtype, "batch": batch,
                     "gpu_ms": round(gpu_ms[False], 3),
                     "gpu_ms_masked": round(gpu_ms[True], 3), "call_ms": round(call_ms, 3),
                     "gpu_ms_per_audio_s": round(per_s, 4),
                     "decoded_frames_per_new_frame": round(steps / utterance_frames, 4),
                     "amortized_gpu_ms_per_audio_s": round(amortized, 4), "graphed": bool(snac._graphs),
                     "capture_s": round(capture_s, 2)})
    return rows


def bench_bridge(snac_dir: str, device: torch.device, dtype: str, repeats: int, warmup: int,
                 batches: tuple[int, ...] = (1, 8, 32, 64)) -> list[dict[str, Any]]:
    """The bridge's continuing decode (3 frames: context, new frame, lookahead) of B streams, as the whole host
    call: graph replay against the eager decode (wall ms; on a GPU the eager one is bound by its ~175 kernel
    launches), and the largest difference between their outputs."""
    snac = StreamingSnac.load(snac_dir, str(device), dtype, max_streams=max(batches), max_batch=max(batches))
    rng = np.random.default_rng(3)
    graphs = dict(snac._bridge_graphs)
    rows = []
    for batch in batches:
        codes = [[tuple(int(c) for c in rng.integers(0, 4096, 7)) for _ in range(3)] for _ in range(batch)]
        args = (codes, [2] * batch, list(range(batch)))
        snac._bridge_graphs = graphs
        _, graphed_ms = timed(lambda a=args: snac._bridge_decode(*a), device, repeats, warmup)
        graphed = snac._bridge_decode(*args)
        snac._bridge_graphs = {}
        _, eager_ms = timed(lambda a=args: snac._bridge_decode(*a), device, repeats, warmup)
        eager = snac._bridge_decode(*args)
        rows.append({"method": "bridge", "dtype": dtype, "batch": batch, "frames": 3, "graphed": bool(graphs),
                     "graphed_call_ms": round(graphed_ms, 3), "eager_call_ms": round(eager_ms, 3),
                     "max_abs_diff": float(np.abs(graphed - eager).max())})
    return rows


def check(snac_dir: str, device: torch.device, with_bf16: bool, variants: list[str]) -> dict[str, Any]:
    """Graphed streaming decode of lengths 1, 7, 23 (one padded batch, streams at different positions) vs the
    full `SNAC.decode` with the same noise; bfloat16 vs float32 streaming (SNR); each other step variant (compiled,
    kernels) in float32 vs `SNAC.decode` too, and in bfloat16 its SNR against the float32 stream."""
    from snac import SNAC

    tf32 = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        rng = np.random.default_rng(2)
        utterances = [[tuple(int(c) for c in rng.integers(0, 4096, 7)) for _ in range(n)] for n in (1, 7, 23)]
        seeds = [11, 12, 13]
        model = SNAC.from_pretrained(snac_dir).eval().to(device)
        refs = [reference_decode(model, [u], [s])[0] for u, s in zip(utterances, seeds, strict=True)]
        result: dict[str, Any] = {}
        streamed: dict[str, list[np.ndarray]] = {}
        others = [v for v in variants if v != "eager"]
        runs = ([("float32", "eager")] + [("bfloat16", "eager")] * with_bf16 + [("float32", v) for v in others]
                + [("bfloat16", v) for v in others] * with_bf16)
        for dtype, variant in runs:
            compile, kernels, heads = VARIANTS[variant]
            snac = StreamingSnac.load(snac_dir, str(device), dtype, max_streams=4, max_batch=4, compile=compile,
                                      kernels=kernels, head_kernels=heads)
            handles = [snac.open_stream(s) for s in seeds]
            pieces: list[list[np.ndarray]] = [[] for _ in handles]
            for tick in range(40):
                for h, u, lag in zip(handles, utterances, (0, 2, 5), strict=True):  # different positions
                    if tick >= lag and not h.finished:
                        snac.push(h, [u[tick - lag]])
                        if h.received == len(u):
                            snac.finish(h)
                for piece, out in zip(snac.step_batch(handles, as_float=True), pieces, strict=True):
                    out.append(piece)
            name = dtype if variant == "eager" else f"{dtype}_{variant}"
            streamed[name] = [np.concatenate(p) for p in pieces]
            result[f"{name}_graphed"] = bool(snac._graphs)
        for name in [n for n in streamed if n.startswith("float32")]:
            diffs = [float(np.abs(a - r).max()) for a, r in zip(streamed[name], refs, strict=True)]
            result[f"{name}_max_abs_diff_vs_snac_decode"] = max(diffs)
            result[f"{name}_exact"] = max(diffs) < 1e-4
        if with_bf16:
            ref = np.concatenate(streamed["float32"])
            for name in [n for n in streamed if n.startswith("bfloat16")]:
                got = np.concatenate(streamed[name])
                result[f"{name}_snr_db"] = round(float(10 * np.log10((ref ** 2).sum() / ((got - ref) ** 2).sum())), 1)
        return result
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32


def _write(path: Path, report: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="64,256,512", help="streams per call, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls (default 50 on CUDA, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 5 / 1)")
    parser.add_argument("--utterance-frames", type=int, default=40, help="for the flush amortization")
    parser.add_argument("--snac-dir", default=None, help="a SNAC checkpoint folder (default: random weights)")
    parser.add_argument("--no-check", action="store_true", help="skip the exactness check")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    parser.add_argument("--snake", choices=("script", "compiled"), default="script",
                        help="Snake activation: snac's TorchScript function, or one torch.compile kernel (fused)")
    parser.add_argument("--stream-variants", default="eager",
                        help="streaming steps to time, comma-separated: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    variants = args.stream_variants.split(",")
    if not set(variants) <= set(VARIANTS):
        parser.error("--stream-variants: " + ", ".join(VARIANTS))
    if args.snake == "compiled":
        use_compiled_snake()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    repeats = args.repeats or (50 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 1)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        snac_dir = args.snac_dir or str(build_test_snac(Path(tmp) / "snac"))
        report: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if cuda else "cpu",
            "torch": torch.__version__, "batches": batches, "dtypes": dtypes, "repeats": repeats,
            "tf32_cudnn": torch.backends.cudnn.allow_tf32 if cuda else None, "snake": args.snake, "results": []}
        if not args.no_check:
            report["check"] = check(snac_dir, device, "bfloat16" in dtypes, variants)
            print("check:", json.dumps(report["check"]), flush=True)
            _write(args.out, report)
        for dtype in dtypes:
            report["results"] += bench_windows(snac_dir, device, dtype, batches, repeats, warmup)
            if cuda:
                torch.cuda.empty_cache()
            for variant in variants:
                report["results"] += bench_stream(snac_dir, device, dtype, batches, repeats, warmup,
                                                  args.utterance_frames, variant)
                if cuda:
                    torch.cuda.empty_cache()
            report.setdefault("bridge", []).extend(bench_bridge(snac_dir, device, dtype, repeats, warmup))
            print("bridge:", json.dumps(report["bridge"][-4:]), flush=True)
            if cuda:
                report.setdefault("max_memory_gib", {})[dtype] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
                torch.cuda.reset_peak_memory_stats()
                torch.cuda.empty_cache()
            _write(args.out, report)  # a lease can be taken back mid-run: keep each dtype's figures as they come
    by_key = {(r["method"], r["dtype"], r["batch"]): r for r in report["results"]}
    for r in report["results"]:
        if r["method"].startswith("stream"):
            w = by_key.get(("windows", r["dtype"], r["batch"]))
            if w:
                ratio = w["amortized_gpu_ms_per_audio_s"] / r["amortized_gpu_ms_per_audio_s"]
                r["windows_over_stream"] = round(ratio, 2)
        w32 = by_key.get(("windows", "float32", r["batch"]))
        if w32:  # the yardstick: the old decoder, windows in float32
            cost = r["amortized_gpu_ms_per_audio_s"] / w32["amortized_gpu_ms_per_audio_s"]
            r["cost_vs_windows_fp32"] = round(cost, 3)
    header = (f"{'method':15} {'dtype':9} {'B':>4} {'gpu_ms':>9} {'masked':>9} {'call_ms':>9} {'ms/audio-s':>11} "
              f"{'frames/new':>10} {'amortized':>10} {'win/str':>8} {'vs w-fp32':>9}")
    print(header)
    for r in report["results"]:
        masked = f"{r['gpu_ms_masked']:.3f}" if "gpu_ms_masked" in r else "-"
        print(f"{r['method']:15} {r['dtype']:9} {r['batch']:>4} {r['gpu_ms']:>9.3f} {masked:>9} {r['call_ms']:>9.3f} "
              f"{r['gpu_ms_per_audio_s']:>11.4f} {r['decoded_frames_per_new_frame']:>10.3f} "
              f"{r['amortized_gpu_ms_per_audio_s']:>10.4f} {r.get('windows_over_stream', ''):>8} "
              f"{r.get('cost_vs_windows_fp32', ''):>9}")
    _write(args.out, report)
    ok = all(v for k, v in report.get("check", {}).items() if k.endswith("_exact"))
    return 0 if ok else 1


if __name__ == "__main__":
    with torch.inference_mode():  # the captured graphs' buffers are inference tensors
        sys.exit(main())
