"""Where a SNAC decoding step's GPU time goes, by kernel kind (torch.profiler):

    python tools/device/snac_profile.py --out snac_profile.json --batch 256 --dtype bfloat16

For each variant, `--steps` launches for B streams, run eagerly (the kernels the CUDA graphs replay, without the
graph's launch savings), each kernel's device time summed per step and grouped into kinds by kernel name:

- windows: one 3-frame window per stream (`windows_baseline.SnacModel`, snac's own decoder), the step of the
  gateway's old windows decoder (the baseline);
- stream: the exact decoder's unmasked step (`StreamingSnac`: gather, decode, scatter, PCM);
- stream-compiled: the same through torch.compile (`StreamingSnac(compile=True)`);
- stream-kernels: compiled, its residual units as the fused Triton kernels (`--snac-kernels`).

The table says what bounds a step: arithmetic (cuDNN/cuBLAS convolutions and GEMMs), PyTorch's generic depthwise
kernel, elementwise passes (aten, TorchScript-fused Snake, Inductor's Triton), copies, gathers. The JSON keeps
every kernel of each variant with its time per step (`kernels`, costliest first), and for stream-compiled the
code Inductor generated is written beside it (`<out>_inductor.py`), so a kernel named in the profile can be read
after the lease. On a CPU the same run profiles aten ops by self CPU time (a smoke check
of the script, not a GPU figure).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from windows_baseline import SnacModel  # tools/device/ is the script's own folder, first on sys.path

from gateway.devtools.devmodels import build_test_snac
from gateway.orpheus import SLOTS_PER_FRAME
from gateway.speech.snac import OPEN_END, StreamingSnac

WINDOW_FRAMES = 3
# (kind, substrings of a kernel's name), first match wins; names lower-cased.
KINDS = (
    ("memcpy", ("memcpy", "memset")),
    ("conv depthwise (aten)", ("depthwise",)),
    ("Inductor (Triton)", ("triton",)),
    ("conv / GEMM (cuDNN, cuBLAS)", ("gemm", "cutlass", "sm80_", "sm90_", "xmma", "cudnn", "convolve", "conv",
                                     "dgrad", "wgrad", "fprop", "nhwc", "winograd")),
    ("Snake (TorchScript fused)", ("fused", "func_", "cudacodegen")),
    ("cat", ("cat",)),
    ("gather / scatter", ("index", "gather", "scatter")),
    ("copy / cast", ("copy", "convert")),
    ("elementwise (aten)", ("elementwise", "reduce")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((kind for kind, keys in KINDS if any(k in low for k in keys)), "other")


def _device_us(event: Any) -> float:
    for attr in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, attr, None)
        if value is not None:
            return float(value)
    return 0.0


def profile_steps(run: Any, device: torch.device, steps: int) -> dict[str, Any]:
    """Kernel time per step by kind (on CPU: aten ops by self CPU time), and the costliest kernels."""
    cuda = device.type == "cuda"
    for _ in range(3):  # warm-up: cuDNN autotuning, TorchScript's fuser, Inductor's compile
        run()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    per_name: dict[str, tuple[float, int]] = {}
    for avg in prof.key_averages():
        on_device = str(getattr(avg, "device_type", "")).endswith("CUDA")
        if cuda and not on_device:
            continue
        us = _device_us(avg) if cuda else float(avg.self_cpu_time_total)
        if us > 0:
            per_name[avg.key] = (us / steps, avg.count // steps)
    kinds: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for name, (us, count) in per_name.items():
        kind = kind_of(name) if cuda else name
        kinds[kind][0] += us
        kinds[kind][1] += count
    total = sum(us for us, _ in per_name.values())
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1][0])
    return {"step_us": round(total, 1), "kernels_per_step": sum(c for _, c in per_name.values()),
            "kinds": {k: {"us": round(us, 1), "share": round(us / total, 3) if total else 0.0, "count": int(n)}
                      for k, (us, n) in sorted(kinds.items(), key=lambda kv: -kv[1][0])},
            "kernels": [{"name": name[:200], "us": round(us, 1), "count": count} for name, (us, count) in ranked]}


def inductor_code(run: Any) -> str:
    """The code Inductor generates for `run`'s compiled step (its first call compiles)."""
    from torch._inductor.utils import run_and_get_code

    _, sources = run_and_get_code(run)
    return "\n\n# ---- next graph ----\n\n".join(sources)


def variant_runs(snac_dir: str, device: torch.device, dtype: str, batch: int, variants: list[str]) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    runs: dict[str, Any] = {}
    if "windows" in variants:
        model = SnacModel.load(snac_dir, str(device), dtype)
        codes = rng.integers(0, 4096, (batch, SLOTS_PER_FRAME * WINDOW_FRAMES), dtype=np.int64)
        runs["windows"] = lambda c=codes: model.decode_codes(c, WINDOW_FRAMES, use_graphs=False)
    for name in ("stream", "stream-compiled", "stream-kernels"):
        if name not in variants:
            continue
        snac = StreamingSnac.load(snac_dir, str(device), dtype, max_streams=batch, capture_graphs=False,
                                  compile=name != "stream", kernels=name == "stream-kernels")
        slots = torch.arange(batch, device=device)
        frames = torch.from_numpy(rng.integers(0, 4096, (batch, 1, SLOTS_PER_FRAME))).to(device)
        mid = torch.full((batch,), 10, device=device)  # every stream mid-utterance: the unmasked step
        ends = torch.full((batch,), OPEN_END, device=device)
        runs[name] = lambda s=snac, a=(slots, frames, mid, ends, slots): s.step(*a, masked=False)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=256, help="streams per step")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--variants", default="windows,stream,stream-compiled")
    parser.add_argument("--snac-dir", default=None, help="a SNAC checkpoint folder (default: random weights)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    variants = args.variants.split(",")
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                              "torch": torch.__version__, "batch": args.batch, "dtype": args.dtype,
                              "steps": args.steps, "variants": {}}
    with tempfile.TemporaryDirectory() as tmp:
        snac_dir = args.snac_dir or str(build_test_snac(Path(tmp) / "snac"))
        for name, run in variant_runs(snac_dir, device, args.dtype, args.batch, variants).items():
            if name == "stream-compiled":
                code = args.out.with_name(f"{args.out.stem}_inductor.py")
                code.parent.mkdir(parents=True, exist_ok=True)
                code.write_text(inductor_code(run))
            report["variants"][name] = profile_steps(run, device, args.steps)
    for name, result in report["variants"].items():
        print(f"{name}: {result['step_us'] / 1000:.2f} ms of kernels per step, {result['kernels_per_step']} kernels "
              f"(B={args.batch}, {args.dtype}, {report['device']})")
        for kind, row in list(result["kinds"].items())[:8]:
            print(f"  {kind[:40]:40} {row['us'] / 1000:8.3f} ms {row['share']:6.1%} {row['count']:6}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main())
