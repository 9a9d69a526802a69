"""The machine a run measured: host, CPU, GPU and library versions (for the JSON report)."""

from __future__ import annotations

import os
import platform
import socket
from pathlib import Path
from typing import Any

import psutil

GIB = 1024**3
CPUINFO = Path("/proc/cpuinfo")


def cpu_model() -> str:
    """The CPU's marketing name (Linux), else whatever platform reports."""
    if CPUINFO.exists():
        for line in CPUINFO.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_info() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        return {"name": "none", "count": 0, "cuda": None}
    return {"name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(), "cuda": torch.version.cuda}


def versions() -> dict[str, str | None]:
    import aiortc
    import torch

    try:
        import vllm

        vllm_version: str | None = vllm.__version__
    except ImportError:
        vllm_version = None
    return {"python": platform.python_version(), "torch": torch.__version__, "vllm": vllm_version,
            "aiortc": aiortc.__version__}


def machine_info() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_cores_logical": os.cpu_count(),
        "cpu_cores_physical": psutil.cpu_count(logical=False),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "gpu": gpu_info(),
        "versions": versions(),
    }
