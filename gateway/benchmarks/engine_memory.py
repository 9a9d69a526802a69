"""Memory per engine of a started synthesizer: what vLLM gave each model's KV cache (blocks, tokens), its share
setting, and the GPU memory its engine core processes hold (nvidia-smi; none without a GPU). Several engines share
one GPU, so the per-engine figures and the device's total are what a table of models costs."""

from __future__ import annotations

import shutil
import subprocess
from typing import Any

from gateway.speech.synthesizer import Synthesizer

NVIDIA_SMI_TIMEOUT_S = 10.0


def engine_memory(synth: Synthesizer) -> dict[str, Any]:
    """`{"engines": {model: {gpu_memory_utilization, kv_cache_memory_gib, blocks, block_size, tokens, core_pids,
    gpu_mib}}, "device": {used_mib, total_mib}}` (GPU figures None where nvidia-smi cannot tell)."""
    by_pid = _gpu_mib_by_pid()
    engines: dict[str, Any] = {}
    for name, engine in synth.engines.items():
        config = synth.config.for_model(name) if synth.table.several else synth.config
        kv_cache = getattr(engine, "kv_cache", None)
        cache: dict[str, Any] = kv_cache() if callable(kv_cache) else {}
        pids = [pid for pid in cache.get("core_pids", []) if pid in by_pid]
        engines[name] = {"gpu_memory_utilization": config.gpu_memory_utilization,
                         "kv_cache_memory_gib": config.kv_cache_memory_gib, **cache,
                         "gpu_mib": sum(by_pid[pid] for pid in pids) if pids else None}
    return {"engines": engines, "device": _device_mib()}


def _smi(query: str) -> list[list[str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [[cell.strip() for cell in line.split(",")] for line in out.splitlines() if line.strip()]


def _gpu_mib_by_pid() -> dict[int, int]:
    rows = _smi("--query-compute-apps=pid,used_memory")
    return {int(pid): int(mib) for pid, mib in (row[:2] for row in rows if len(row) >= 2)
            if pid.isdigit() and mib.isdigit()}


def _device_mib() -> dict[str, int | None]:
    rows = _smi("--query-gpu=memory.used,memory.total")
    if not rows or len(rows[0]) < 2 or not all(cell.isdigit() for cell in rows[0][:2]):
        return {"used_mib": None, "total_mib": None}
    return {"used_mib": int(rows[0][0]), "total_mib": int(rows[0][1])}
