"""How the processes of `serve --workers` wait for their end: SIGTERM (the supervisor) or SIGINT (a terminal)."""

from __future__ import annotations

import asyncio
import signal


async def until_stop_signal() -> None:
    """Return once this process gets SIGTERM or SIGINT (the event loop's handlers replace the default exit)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
