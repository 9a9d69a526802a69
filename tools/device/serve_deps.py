"""Make `vllm serve` importable on the device: install, from a folder of wheels, only the modules it lacks.

The slim vLLM tree (../shared/tools/device-vllm) carries what the offline engine needs; the OpenAI server
imports more (uvicorn, uvloop, model_hosting_container_standards, anthropic, ...). Installing a whole pool
could shadow the device's own packages, so this tries the import, installs the wheel that provides the
missing module, and tries again. `python3 tools/device/serve_deps.py POOL_DIR [TARGET]`.
"""

from __future__ import annotations

import re
import subprocess
import sys
import zipfile
from pathlib import Path

PROBE = "import vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.main, vllm.entrypoints.cli.serve"
MAX_ROUNDS = 40


def provided_modules(wheel: Path) -> set[str]:
    """Top-level import names in a wheel (packages, modules, extension modules)."""
    names = set()
    with zipfile.ZipFile(wheel) as archive:
        for entry in archive.namelist():
            top = entry.split("/")[0]
            if not top.endswith((".dist-info", ".data")):
                names.add(top.split(".")[0])
    return names


def main() -> int:
    pool, target = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "/tmp/site"
    index = {name: wheel for wheel in sorted(pool.glob("*.whl")) for name in provided_modules(wheel)}
    installed: list[str] = []
    for _ in range(MAX_ROUNDS):
        probe = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True)
        if probe.returncode == 0:
            print(f"vllm serve imports; installed {installed}")
            return 0
        missing = re.search(r"No module named '([^']+)'", probe.stderr)
        wheel = index.get(missing.group(1).split(".")[0]) if missing else None
        if wheel is None or wheel.name in installed:
            print(f"cannot fix the import (installed {installed}):\n{probe.stderr[-3000:]}")
            return 1
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--no-compile",
                        "--target", target, str(wheel)], check=True)
        installed.append(wheel.name)
    return 1


if __name__ == "__main__":
    sys.exit(main())
