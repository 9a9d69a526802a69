"""A worker process of `orpheus-gateway serve --workers N` (`python -m gateway.cluster.workers`, started by the
supervisor): the whole gateway app on the shared public port (SO_REUSEPORT: the kernel spreads new connections) and
on a Unix socket of its own, with the engine remote (`vllm serve`), its share of the session slots, and requests
about other workers' sessions passed on (`forwarding`). Why processes sharing one `vllm serve`:
docs/decisions/workers-share-vllm-serve.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from gateway.cluster.addressing import (
    STREAM_COUNTS_NAME,
    WORKER_CONFIG_ENV,
    WORKER_INDEX_ENV,
    WORKER_SOCKETS_ENV,
    session_prefix,
    socket_path,
)
from gateway.cluster.forwarding import forward_to_owner
from gateway.cluster.lifecycle import until_stop_signal
from gateway.config import GatewayConfig, validate
from gateway.service.admission import StreamCounts, stream_count_columns

log = logging.getLogger(__name__)


def worker_config(config: GatewayConfig, workers: int, vllm_urls: Sequence[str]) -> GatewayConfig:
    """One worker's: the engine is remote, and the sessions are divided among the workers (an offer a full worker
    cannot take goes to another). The utterance limits stay gateway-wide: each worker counts every worker's
    utterances against them (`StreamCounts`)."""
    def share(value: int) -> int:
        return max(1, math.ceil(value / workers)) if value else value

    return dataclasses.replace(config, vllm_urls=tuple(vllm_urls), workers=1, snac_placement="process",
                               snac_mps_priority="normal",  # the supervisor's SNAC process takes that setting
                               max_sessions=share(config.max_sessions))


async def serve_worker(config: GatewayConfig, index: int, sockets: str) -> None:
    """One worker: the whole gateway app on the shared public port and on its own Unix socket."""
    from gateway.edge.app import create_app

    counts = StreamCounts(Path(sockets) / STREAM_COUNTS_NAME, index, stream_count_columns(config))
    app = create_app(config, session_id_prefix=session_prefix(index), stream_counts=counts)
    app.middlewares.append(forward_to_owner)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, reuse_port=True).start()
    path = socket_path(sockets, index)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    await web.UnixSite(runner, str(path)).start()
    log.info("worker %d (pid %d) serving on %s:%d", index, os.getpid(), config.host, config.port)
    try:
        await until_stop_signal()
    finally:
        await runner.cleanup()
        for column in range(counts.columns):
            counts.publish(0, column)
        counts.close()


def worker_main() -> int:
    """Entry point of a worker process (`python -m gateway.cluster.workers`), started by the supervisor."""
    fields = json.loads(os.environ[WORKER_CONFIG_ENV])
    fields["vllm_urls"] = tuple(fields["vllm_urls"])
    config = GatewayConfig(**fields)
    validate(config)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s w{os.environ[WORKER_INDEX_ENV]} %(name)s: %(message)s")
    from gateway.media.avthreads import use_one_ffmpeg_thread

    use_one_ffmpeg_thread()
    asyncio.run(serve_worker(config, int(os.environ[WORKER_INDEX_ENV]), os.environ[WORKER_SOCKETS_ENV]))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
