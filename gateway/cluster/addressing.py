"""How the processes of `serve --workers` find each other: the environment the supervisor hands each child, the
files of the sockets folder (each worker's Unix socket, the shared SNAC socket, the utterance counts), the headers a
worker marks its answers and relayed requests with, and the session id prefix that names a session's worker.
"""

from __future__ import annotations

from pathlib import Path

WORKER_CONFIG_ENV = "ORPHEUS_GATEWAY_WORKER_CONFIG"  # the supervisor's resolved config, as JSON
WORKER_INDEX_ENV = "ORPHEUS_GATEWAY_WORKER_INDEX"
WORKER_SOCKETS_ENV = "ORPHEUS_GATEWAY_WORKER_SOCKETS"  # folder of the workers' Unix sockets
WORKER_HEADER = "X-Gateway-Worker"  # which worker answered (operations, tests)
FORWARDED_HEADER = "X-Gateway-Forwarded-By"  # the worker that passed the request on to the owner
SNAC_SOCKET_NAME = "snac.sock"  # snac_placement shared: in the sockets folder
STREAM_COUNTS_NAME = "streams.counts"  # every worker's utterances in flight (`StreamCounts`): in the sockets folder


def session_prefix(index: int) -> str:
    return f"w{index}-"


def socket_path(folder: str | Path, index: int) -> Path:
    return Path(folder) / f"w{index}.sock"
