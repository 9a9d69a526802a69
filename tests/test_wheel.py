"""What installs is what runs: the wheel built from this tree, installed (not editable) into a fresh venv, holds the
page and the benchmarks and nothing of the development tooling, and its `orpheus-gateway` serves the page, answers
health before the engine is ready, and speaks. The fresh venv borrows the test venv's third-party packages through a
path file (not its editable install of this tree), so the wheel's own files are what import."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import sysconfig
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from gateway.orpheus import SAMPLES_PER_FRAME
from tests.support import cli_env, free_port

ROOT = Path(__file__).resolve().parent.parent
WEB_FILES = sorted(p.name for p in (ROOT / "gateway" / "web").iterdir() if p.is_file())
NOT_SHIPPED = ("bench/", "tools/", "tests/", "docs/", "examples/")  # top-level folders that stay out of the wheel


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def run(self, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=300, cwd=self.venv, env=env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "--wheel-dir", str(out / "dist"), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (out / "dist").glob("orpheus_gateway-*.whl")
    venv = out / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install",
                           "--no-deps", "--no-index", "-q", str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path("
                                "'purelib'))"], capture_output=True, text=True, check=True).stdout.strip())
    (site / "test-venv-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    yield Installed(wheel, venv)


def test_the_wheel_ships_the_page_and_the_benchmarks_and_no_tooling(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    assert {f"gateway/web/{name}" for name in WEB_FILES} <= set(names), sorted(set(WEB_FILES) - set(names))
    assert "gateway/benchmarks/run.py" in names and "gateway/benchmarks/README.md" in names
    shipped_tooling = [n for n in names if n.startswith(NOT_SHIPPED)]
    assert not shipped_tooling, shipped_tooling


def test_the_installed_package_is_the_one_that_imports(installed: Installed) -> None:
    where = installed.run(installed.bin("python"), "-c", "import gateway; print(gateway.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert Path(where.stdout.strip()).is_relative_to(installed.venv), where.stdout


def test_help_and_bench_help_work_without_the_plotting_extra(installed: Installed, tmp_path: Path) -> None:
    """`bench --help` needs only the runtime dependencies: matplotlib (the bench extra) made unimportable here."""
    blocker = tmp_path / "blocker" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'matplotlib'\")\n")
    env = {**cli_env(), "PYTHONPATH": str(blocker.parent)}
    for argv in (["--help"], ["serve", "--help"], ["bench", "--help"]):
        proc = installed.run(installed.bin("orpheus-gateway"), *argv, env=env)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
        assert "usage: orpheus-gateway" in proc.stdout, (argv, proc.stdout[:500])
    assert "--scenario" in proc.stdout
    check = installed.run(installed.bin("python"), "-c", "import matplotlib", env=env)
    assert check.returncode != 0, "the blocker must hide matplotlib for this test to mean anything"


@pytest.mark.engine
async def test_installed_serve_serves_the_page_is_healthy_before_ready_and_speaks(
        installed: Installed, tiny_model_dir: Path, tiny_snac_dir: Path) -> None:
    port = free_port()
    log_path = tiny_model_dir.parent / f"wheel-serve-{port}.log"
    with open(log_path, "wb") as log:  # noqa: ASYNC230 -- once, before the child starts: nothing waits on it
        proc = await asyncio.create_subprocess_exec(
            installed.bin("orpheus-gateway"), "serve", "--host", "127.0.0.1", "--port", str(port),
            "--model", str(tiny_model_dir), "--snac-model", str(tiny_snac_dir), "--snac-device", "cpu",
            env=cli_env(), stdout=log, stderr=log, cwd=installed.venv)
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            saw_not_ready = page_checked = False
            for _ in range(600):
                try:
                    async with http.get(f"{base}/healthz") as health, http.get(f"{base}/readyz") as ready:
                        assert health.status == 200
                        if ready.status == 503:
                            saw_not_ready = True
                        elif ready.status == 200:
                            break
                    if not page_checked:  # the page is served at once, from the installed package
                        await _check_page(http, base)
                        page_checked = True
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.5)
            else:
                raise AssertionError(f"gateway never became ready:\n{log_path.read_text(errors='replace')[-3000:]}")
            assert saw_not_ready, "/healthz answered while the engine was still loading"
            assert page_checked
            body = {"input": "Ready now.", "response_format": "pcm"}
            async with http.post(f"{base}/v1/audio/speech", json=body) as r:
                assert r.status == 200
                assert len(await r.read()) % (2 * SAMPLES_PER_FRAME) == 0
        # The default ladder (1..256, within max_num_seqs 8) is capped on a CPU: ready soon after the engine.
        assert "vLLM engine warmed up at batch sizes [1, 2] in" in log_path.read_text(errors="replace")
    finally:
        proc.send_signal(signal.SIGINT)  # Ctrl-C, as a person stops it
        await asyncio.wait_for(proc.wait(), 60)
    # A clean stop says nothing alarming (vLLM's output handler, stopped after its engine, logged a traceback).
    said = log_path.read_text(errors="replace")
    assert "Traceback" not in said and "output_handler failed" not in said, said[-3000:]


async def _check_page(http: aiohttp.ClientSession, base: str) -> None:
    async with http.get(f"{base}/") as page:
        assert page.status == 200 and page.content_type == "text/html"
        assert await page.read() == (ROOT / "gateway" / "web" / "index.html").read_bytes()
    for name in WEB_FILES:
        if name == "index.html":
            continue
        async with http.get(f"{base}/static/{name}") as r:
            assert r.status == 200, name
            assert await r.read() == (ROOT / "gateway" / "web" / name).read_bytes(), name
