"""The shared SNAC process of `serve --workers` (`python -m gateway.cluster.snac_process`; the supervisor starts
and restarts it): the codec server its settings describe (`gateway.speech.codec.server`, settings as JSON in
ORPHEUS_GATEWAY_SNAC_SERVER), and its metrics (`SnacMetrics`: passes, batch sizes, pass durations; and the lag of
the loop that serves the streams) on a Unix socket beside the codec socket (`metrics_socket_path`). SNAC is the
pipeline's main GPU cost, so its batching must be visible where the decoding happens: the workers' `/metrics`
gathers these with their own, labelled `worker="snac"`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
from pathlib import Path

from aiohttp import web
from prometheus_client import CollectorRegistry

from gateway.cluster.lifecycle import until_stop_signal
from gateway.service.loop_lag import LoopLagMonitor
from gateway.service.metrics import CONTENT_TYPE, METRICS_PATH, SnacMetrics, loop_lag_histogram
from gateway.speech.codec.server import SERVER_ENV, CodecServerSettings, StreamCodecServer

log = logging.getLogger(__name__)

SNAC_LABEL = "snac"  # the worker label of its samples in the merged /metrics


def metrics_socket_path(snac_socket: str | Path) -> Path:
    """Where the SNAC process behind `snac_socket` serves its metrics."""
    path = Path(snac_socket)
    return path.with_name(f"{path.stem}-metrics.sock")


async def serve(settings: CodecServerSettings) -> None:
    """Decode for every worker and answer `GET /metrics` until SIGTERM or SIGINT."""
    metrics = SnacMetrics(CollectorRegistry())
    server = await asyncio.to_thread(StreamCodecServer.load, settings)  # loads SNAC, captures its graphs: seconds
    metrics.watch(server.decoder)
    server.start()
    # The loop that takes every worker's frames and sends their audio back: late here is late for every peer.
    lag = LoopLagMonitor(loop_lag_histogram(metrics.registry).observe)
    server.run_in_loop(_start(lag))

    async def render(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    app = web.Application()
    app.router.add_get(METRICS_PATH, render)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    path = metrics_socket_path(settings.socket)
    path.unlink(missing_ok=True)  # a server of an earlier process
    await web.UnixSite(runner, str(path)).start()
    try:
        await until_stop_signal()
    finally:
        await runner.cleanup()
        path.unlink(missing_ok=True)
        with contextlib.suppress(Exception):  # closing regardless
            await asyncio.to_thread(server.run_in_loop, lag.stop())
        await asyncio.to_thread(server.close)


async def _start(monitor: LoopLagMonitor) -> None:
    monitor.start()  # in the loop that runs this


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s snac-server %(message)s")
    text = os.environ.get(SERVER_ENV)
    if not text:
        log.error("%s is not set: nothing to serve", SERVER_ENV)
        return 2
    try:
        settings = CodecServerSettings.from_env(text)
    except (ValueError, KeyError, TypeError) as exc:  # JSON errors are ValueErrors
        log.error("%s is not CodecServerSettings JSON (docs/operations.md): %r", SERVER_ENV, exc)
        return 2
    asyncio.run(serve(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
