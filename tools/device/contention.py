"""How much does SNAC decoding slow generation, from another process (two CUDA contexts) or from the engine's own?

The GPU time-slices between processes: SNAC in the gateway process and the model in vLLM's engine-core process
never run at once. Kernels of one process on different streams can. This measures the difference before any
code moves: vLLM's engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), and a fixed SNAC load
(the 3-frame windows of N real-time streams, `windows_baseline`: one new frame per stream every 85 ms) runs
  - nowhere (alone), - in a thread of this process on its own CUDA stream (same context),
  - in a child process (own context, as a gateway process or the shared SNAC process does).
Usage: python3 tools/device/contention.py MODEL_DIR OUT [streams,...] [tokens]
Writes OUT/contention.json and prints a table.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

FRAME_S = 2048 / 24000
WINDOW_FRAMES = 3  # context 1 + new 1 + lookahead 1
PERIOD_S = 0.010  # one SNAC batch per 10 ms, as the batcher runs under steady load
MAX_BATCH = 256


class SnacLoad:
    """Decodes the windows `streams` real-time streams produce, in one batch per PERIOD_S, on its own stream."""

    def __init__(self, snac_dir: str) -> None:
        import torch
        from windows_baseline import SnacModel  # tools/device/ is the script's own folder, first on sys.path

        self.torch = torch
        self.model = SnacModel.load(snac_dir, "cuda")
        self.model.capture_graphs([WINDOW_FRAMES], MAX_BATCH)
        self.stream = torch.cuda.Stream()
        self.codes = np.random.default_rng(0).integers(0, 4096, (MAX_BATCH, 7 * WINDOW_FRAMES), dtype=np.int64)
        self._stop = threading.Event()
        self.batch_ms: list[float] = []
        self.windows = 0

    def run(self, streams: int, seconds: float | None = None) -> None:
        rate = streams / FRAME_S  # windows per second
        self._stop.clear()
        self.batch_ms, self.windows = [], 0
        t0 = time.perf_counter()
        with self.torch.cuda.stream(self.stream):
            while not self._stop.is_set() and (seconds is None or time.perf_counter() - t0 < seconds):
                owed = int(rate * (time.perf_counter() - t0)) - self.windows
                if owed <= 0:
                    time.sleep(PERIOD_S / 4)
                    continue
                batch = min(owed, MAX_BATCH)
                b0 = time.perf_counter()
                self.model.decode_codes(self.codes[:batch], WINDOW_FRAMES)
                self.batch_ms.append((time.perf_counter() - b0) * 1000)
                self.windows += batch
                time.sleep(max(0.0, PERIOD_S - (time.perf_counter() - b0)))
        self.elapsed = time.perf_counter() - t0

    def stop(self) -> None:
        self._stop.set()

    def summary(self) -> dict[str, float]:
        ms = self.batch_ms or [0.0]
        return {"batches": len(self.batch_ms), "windows_per_s": round(self.windows / max(self.elapsed, 1e-9), 1),
                "batch_ms_p50": round(statistics.median(ms), 2),
                "batch_ms_p95": round(float(np.percentile(ms, 95)), 2),
                "busy": round(sum(self.batch_ms) / 1000 / max(self.elapsed, 1e-9), 3)}


def child(snac_dir: str) -> None:
    """`contention.py --child SNAC_DIR`: lines on stdin: `<streams>` starts a load, `stop` ends it (JSON out)."""
    load = SnacLoad(snac_dir)
    print("ready", flush=True)
    thread: threading.Thread | None = None
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stop" and thread is not None:
            load.stop()
            thread.join()
            print(json.dumps(load.summary()), flush=True)
        elif cmd.isdigit():
            thread = threading.Thread(target=load.run, args=(int(cmd),))
            thread.start()


def main() -> None:
    if sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    model_dir, out = sys.argv[1], Path(sys.argv[2])
    streams_list = [int(s) for s in (sys.argv[3] if len(sys.argv) > 3 else "192,384").split(",")]
    tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 504
    out.mkdir(parents=True, exist_ok=True)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core (and the model) in this process
    proc = subprocess.Popen([sys.executable, __file__, "--child", f"{model_dir}/snac"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048, max_num_seqs=512,
              enable_prefix_caching=True, gpu_memory_utilization=0.5, disable_log_stats=True)
    load = SnacLoad(f"{model_dir}/snac")
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline().strip() == "ready"
    params = SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.1, max_tokens=tokens, ignore_eos=True,
                            detokenize=False, seed=0)
    rng = np.random.default_rng(1)

    def generate(n: int) -> float:
        prompts = [{"prompt_token_ids": [128259, 128000, *rng.integers(1000, 100000, 34).tolist(),
                                         128009, 128260, 128261, 128257]} for _ in range(n)]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t0

    generate(64)  # first-use compilation out of the way
    rows = []
    for n in streams_list:
        load.run(n, seconds=3.0)
        alone_snac = load.summary()
        for variant in ("alone", "thread", "process", "alone again"):
            thread = None
            if variant == "thread":
                thread = threading.Thread(target=load.run, args=(n,))
                thread.start()
            elif variant == "process":
                proc.stdin.write(f"{n}\n")
                proc.stdin.flush()
            time.sleep(0.2)
            wall = generate(n)
            snac: dict[str, float] = {}
            if thread is not None:
                load.stop()
                thread.join()
                snac = load.summary()
            elif variant == "process":
                proc.stdin.write("stop\n")
                proc.stdin.flush()
                snac = json.loads(proc.stdout.readline())
            rate = tokens / wall
            row = {"streams": n, "snac": variant, "wall_s": round(wall, 2), "tok_s_per_stream": round(rate, 1),
                   "real_time": round(rate / (7 / FRAME_S), 2), "snac_stats": snac, "snac_alone": alone_snac}
            rows.append(row)
            print(json.dumps(row), flush=True)
    proc.stdin.close()
    proc.wait(timeout=30)
    import torch

    (out / "contention.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "tokens": tokens,
                                                     "window_frames": WINDOW_FRAMES, "rows": rows}, indent=1))
    print(f"\n{'streams':>7} {'SNAC':>12} {'wall s':>7} {'tok/s/stream':>12} {'x real time':>11} "
          f"{'SNAC win/s':>10} {'batch ms p50':>12} {'busy':>5}")
    for r in rows:
        s = r["snac_stats"]
        print(f"{r['streams']:>7} {r['snac']:>12} {r['wall_s']:>7} {r['tok_s_per_stream']:>12} {r['real_time']:>11} "
              f"{s.get('windows_per_s', '-'):>10} {s.get('batch_ms_p50', '-'):>12} {s.get('busy', '-'):>5}")
    print("SNAC alone (no generation):", {r["streams"]: r["snac_alone"] for r in rows if r["snac"] == "alone"})


if __name__ == "__main__":
    main()
