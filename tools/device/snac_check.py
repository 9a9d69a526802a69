"""GPU preflight of SNAC's CUDA graphs on the windows baseline (`windows_baseline.SnacModel`, the gateway's decoder
before the exact stream): CUDA-graphed decoding must equal eager decoding, and how fast, in float32 and half
precision. The exact stream's own graphs are checked against `SNAC.decode` by `snac_stream_bench.py` (`check`).

Run on the device after call 1 built the model: `python3 tools/device/snac_check.py /tmp/orpheus-struct/snac OUT`.
Writes OUT/snac_check.json; exit status 1 if a graphed batch differs from eager beyond the tolerance (then
the benchmark runs with --no-snac-cuda-graphs).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from windows_baseline import SnacModel  # tools/device/ is the script's own folder, first on sys.path

WINDOW_FRAMES = (2, 3, 4, 5, 6)  # every window length the old decoder used: context 1, lookahead 1, hop 1..4
CHECK_BATCHES = (1, 5, 64, 200, 256)
TIME_BATCHES = (1, 16, 64, 128, 256)
MAX_BATCH = 256
HALF_DTYPES = ("bfloat16", "float16")
HALF_FRAMES = (3, 6)
TOLERANCE = 33  # int16 steps (1e-3 of full scale): graph replay runs the same kernels; only
# nondeterministic reductions may differ
REPEATS = 20


def codes_for(batch: int, frames: int) -> np.ndarray:
    """Random window rows (`windows_baseline`): [batch, 7 * frames]."""
    return np.random.default_rng(batch * 100 + frames).integers(0, 4096, (batch, 7 * frames), dtype=np.int64)


def median_ms(fn) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(REPEATS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1000)
    return round(statistics.median(times), 3)


def _silence_noise(model: torch.nn.Module) -> None:
    """SNAC's NoiseBlocks add fresh random noise on every call, so two decodes never match: scale it to 0."""
    from snac.layers import NoiseBlock

    for module in model.modules():
        if isinstance(module, NoiseBlock):
            module.forward = lambda x: x  # type: ignore[method-assign]


def main() -> int:
    snac_dir, out = sys.argv[1], Path(sys.argv[2])
    snac = SnacModel.load(snac_dir, "cuda")
    _silence_noise(snac.model)
    t0 = time.perf_counter()
    snac.capture_graphs(WINDOW_FRAMES, MAX_BATCH)  # one memory pool for all lengths
    graphs = {g.frames: g for g in snac._graphed}
    assert sorted(graphs) == sorted(WINDOW_FRAMES), f"captured {sorted(graphs)}"
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "capture_s": round(time.perf_counter() - t0, 2),
                                 "max_abs_diff": {}, "ms_per_batch": {}}
    ok = True
    # Whole calls, host copies included: codes in from host memory, int16 PCM back in host memory.
    for frames in graphs:
        for batch in CHECK_BATCHES:
            codes = codes_for(batch, frames)
            graphed = snac.decode_codes(codes, frames).astype(np.int32)
            eager = snac.decode_codes(codes, frames, use_graphs=False).astype(np.int32)
            diff = int(np.abs(graphed - eager).max())
            report["max_abs_diff"][f"{frames}f-B{batch}"] = diff  # type: ignore[index]
            ok &= diff <= TOLERANCE
        for batch in TIME_BATCHES:
            codes = codes_for(batch, frames)
            report["ms_per_batch"][f"{frames}f-B{batch}"] = {  # type: ignore[index]
                "eager": median_ms(lambda c=codes, f=frames: snac.decode_codes(c, f, use_graphs=False)),
                "graph": median_ms(lambda c=codes, f=frames: snac.decode_codes(c, f))}
    # Half precision: the same windows through a bfloat16 / float16 copy of the decoder, as SNR against float32
    # (random weights: the real checkpoint's audio must be checked by ear before a production default).
    report["half"] = {}
    for dtype in HALF_DTYPES:
        half = SnacModel.load(snac_dir, "cuda", dtype)
        _silence_noise(half.model)
        half.capture_graphs(HALF_FRAMES, MAX_BATCH)
        entry: dict[str, object] = {}
        for frames in HALF_FRAMES:
            codes = codes_for(64, frames)
            ref = snac.decode_codes(codes, frames).astype(np.float64)
            got = half.decode_codes(codes, frames).astype(np.float64)
            noise = max(float(((ref - got) ** 2).sum()), 1e-9)
            entry[f"{frames}f-snr_db"] = round(float(10 * np.log10(float((ref ** 2).sum()) / noise)), 1)
            for batch in TIME_BATCHES:
                timed = codes_for(batch, frames)
                entry[f"{frames}f-B{batch}-ms"] = median_ms(lambda c=timed, f=frames, h=half: h.decode_codes(c, f))
        report["half"][dtype] = entry  # type: ignore[index]
    report["ok"] = ok
    out.mkdir(parents=True, exist_ok=True)
    (out / "snac_check.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
