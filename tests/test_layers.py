"""The package layers hold: the import-linter contract in pyproject.toml (no package imports one above it, siblings
stay independent, type-only imports included), no import cycle between any two modules, and every layer opens with
a docstring saying what it owns and may import."""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("config", "speech", "media", "service", "timing", "rtc", "edge", "cluster", "devtools")


def test_import_linter_contract_is_kept() -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "1 kept, 0 broken" in done.stdout


def test_the_contract_would_catch_an_upward_import(tmp_path: Path) -> None:
    """The contract is live: the same check on a copy with one upward import (media -> rtc) fails."""
    copy = tmp_path / "repo"
    shutil.copytree(ROOT / "gateway", copy / "gateway", ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    playout = copy / "gateway" / "media" / "playout.py"
    playout.write_text(playout.read_text() + "\nfrom gateway.rtc import protocol  # noqa: E402,F401\n")
    done = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=copy,
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(copy), "PATH": ""})
    assert done.returncode != 0 and "broken" in done.stdout


def test_no_import_cycles() -> None:
    graph = grimp.build_graph("gateway", include_external_packages=False, exclude_type_checking_imports=False)
    modules = sorted(graph.modules)
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for nxt in edges[module]:
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in modules:
        if module not in state:
            cycle = visit(module)
            assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("layer", LAYERS)
def test_each_layer_says_what_it_owns_and_may_import(layer: str) -> None:
    doc = importlib.import_module(f"gateway.{layer}").__doc__ or ""
    assert "Owns" in doc and "May import" in doc, f"gateway/{layer}/__init__.py needs its docstring"
