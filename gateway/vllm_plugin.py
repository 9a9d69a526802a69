"""vLLM general plugin (entry point `vllm.general_plugins`): SNAC decoding inside vLLM's engine-core process.

vLLM calls `register()` in each of its processes. In the engine core (where, with one GPU, the model runs)
and only when the gateway set `ORPHEUS_GATEWAY_SNAC_SERVER`, it loads SNAC and serves it on a Unix socket
(`gateway.codec_server`): SNAC's kernels then run in the model's CUDA context, on their own stream, beside
the model's instead of time-sliced against them. Nothing else of the gateway is loaded there.

SNAC is loaded and its CUDA graphs captured here, synchronously, before vLLM touches the GPU: a graph capture
of ours while vLLM captures its own would break vLLM's. The decode thread then only replays graphs, and only
once a gateway connects, after the engine is up. vLLM must start the engine core with `spawn` (the gateway
sets VLLM_WORKER_MULTIPROC_METHOD): a forked child inherits "plugins already loaded" and would skip this.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

log = logging.getLogger(__name__)

ENGINE_CORE_PROCESS = "EngineCore"  # vLLM's name for its engine-core process (EngineCore_DP<i> with DP)
_server = None  # the process's server: register() may be called more than once


def register() -> None:
    global _server
    from gateway.codec_server import SERVER_ENV, serve_from_env

    # With data parallelism the first engine core serves; the others' GPUs only generate.
    in_first_engine_core = multiprocessing.current_process().name in (ENGINE_CORE_PROCESS, f"{ENGINE_CORE_PROCESS}_DP0")
    if _server is not None or not os.environ.get(SERVER_ENV) or not in_first_engine_core:
        return
    try:
        _server = serve_from_env()
    except Exception:  # the engine still starts; gateways then report the socket unreachable per batch
        log.exception("could not start SNAC decoding in the engine core")
