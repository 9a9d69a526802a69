"""What a worker of `serve --workers` passes on to the others (the `forward_to_owner` middleware): a request about
another worker's session goes to its owner over the owner's Unix socket (a session lives in the worker that answered
its offer), a new session's offer this worker has no slot for goes to one that has (the kernel spreads connections
by hash, not by load), and `/metrics` gathers every worker's and the SNAC process's. Why whole processes and how
offers spread: docs/decisions/workers-share-vllm-serve.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.cluster.addressing import FORWARDED_HEADER, WORKER_HEADER, WORKER_SOCKETS_ENV, socket_path
from gateway.cluster.snac_process import SNAC_LABEL, metrics_socket_path
from gateway.edge.http import GATEWAY_KEY, SESSION_OFFER_ROUTES, json_error
from gateway.service.errors import AT_CAPACITY
from gateway.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.service.metrics import METRICS_PATH, merge_worker_expositions

# A request about one session (the JSON route's DELETE, WHEP's DELETE/PATCH): its id names the owning worker.
SESSION_PATH = re.compile(r"^/.*/(w(\d+)-[0-9a-f]+)$")
FORWARD_TIMEOUT_S = 10.0
# Not passed on from a worker's answer: aiohttp sets its own for the response it relays, and the relaying worker
# adds the CORS ones itself (`edge.app.add_cors_headers`; a relayed Vary would say Origin twice).
RELAY_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date",
                                   "server", "vary", "access-control-allow-origin", "access-control-expose-headers"})
METRICS_FETCH_TIMEOUT_S = 2.0  # a hung worker is left out of /metrics, well inside Prometheus' 10 s scrape timeout


def worker_name(request: web.Request) -> str:
    """The name of the worker answering `request` ("w<index>", its session ids' prefix; "" outside `--workers`)."""
    return request.app[GATEWAY_KEY].session_id_prefix.strip("-")


def other_workers(folder: str | Path, own: str) -> list[Path]:
    """The Unix sockets of the workers other than `own` ("w<index>") in `folder`, from the next index up and
    around (so that workers passing offers on do not all try the same one first). Blocking: a directory listing."""
    mine = int(own[1:]) if own[1:].isdigit() else -1
    found = [(int(p.stem[1:]), p) for p in Path(folder).glob("w*.sock") if p.stem[1:].isdigit() and p.stem != own]
    return [path for _, path in sorted(found, key=lambda item: (item[0] < mine, item[0]))]


@web.middleware
async def forward_to_owner(request: web.Request, handler: Any) -> web.StreamResponse:
    """A request about another worker's session goes to that worker, over its Unix socket; a new session's offer
    this worker has no slot for goes to one that has (`_offer_elsewhere`); `/metrics` gathers every worker's."""
    if request.path == METRICS_PATH and FORWARDED_HEADER not in request.headers:
        return await all_workers_metrics(request, handler)
    match = SESSION_PATH.match(request.path)
    gateway = request.app[GATEWAY_KEY]
    if match is None or match.group(1).startswith(gateway.session_id_prefix):
        if _is_offer_without_room(request):
            if FORWARDED_HEADER in request.headers:  # the passing worker tries the next, and counts a refusal
                return json_error(503, AT_CAPACITY, f"no session slot in {worker_name(request)}")
            if (taken := await _offer_elsewhere(request)) is not None:
                return taken
        response = await handler(request)  # here, or refused here (and counted once) when every worker is full
        if not response.prepared:  # a streamed response (speech) has sent its headers already
            response.headers[WORKER_HEADER] = worker_name(request)
        return response
    owner = int(match.group(2))
    folder = os.environ.get(WORKER_SOCKETS_ENV, "")
    path = socket_path(folder, owner)
    if not folder or not path.exists():
        return json_error(404, "unknown_session", "no such session")
    try:
        return await _relay(request, path)
    except (TimeoutError, aiohttp.ClientError, OSError):
        return json_error(503, "worker_unavailable", f"the worker holding this session ({owner}) does not answer")


def _is_offer_without_room(request: web.Request) -> bool:
    """A new session's offer (JSON or WHEP) that this worker, one of several, has no session slot for."""
    return (request.method == "POST" and request.match_info.route.name in SESSION_OFFER_ROUTES
            and bool(os.environ.get(WORKER_SOCKETS_ENV)) and request.app[GATEWAY_KEY].admission.sessions_full)


async def _offer_elsewhere(request: web.Request) -> web.Response | None:
    """The first answer to this offer from the other workers, in turn from the next one up (so that full workers
    spread what they pass on), that is not `at_capacity`; None when none has a slot or answers (then this worker
    refuses it itself, with its Retry-After)."""
    own = worker_name(request)
    for path in await asyncio.to_thread(other_workers, os.environ[WORKER_SOCKETS_ENV], own):
        try:
            answer = await _relay(request, path)
        except (TimeoutError, aiohttp.ClientError, OSError):
            continue  # restarting, or gone: the next one
        if answer.status == 503 and _error_code(answer) == AT_CAPACITY:
            continue
        return answer
    return None


def _error_code(response: web.Response) -> str | None:
    try:
        return str(json.loads(bytes(response.body))["error"]["code"])  # type: ignore[arg-type]
    except (ValueError, TypeError, KeyError):
        return None


async def _relay(request: web.Request, path: Path) -> web.Response:
    """This request as another worker (at its Unix socket `path`) answers it, marked as passed on by this one."""
    own = worker_name(request)
    headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
    headers[FORWARDED_HEADER] = own
    body = await request.read()  # aiohttp keeps it: a relay after another reads the same bytes
    connector = aiohttp.UnixConnector(path=str(path))
    timeout = aiohttp.ClientTimeout(FORWARD_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as http, \
            http.request(request.method, f"http://worker{request.rel_url}", headers=headers, data=body) as resp:
        payload = await resp.read()
        response = web.Response(status=resp.status, body=payload, headers=[
            (k, v) for k, v in resp.headers.items() if k.lower() not in RELAY_DROPPED_HEADERS])
        response.headers[WORKER_HEADER] = resp.headers.get(WORKER_HEADER, "")
        response.headers[FORWARDED_HEADER] = own
        return response


async def all_workers_metrics(request: web.Request, handler: Any) -> web.StreamResponse:
    """This worker's metrics and every other worker's (asked over their Unix sockets), each sample labelled
    with its worker, and the shared SNAC process's (`worker="snac"`); a process that does not answer is left out
    (`orpheus_metrics_workers` says how many workers did)."""
    local = await handler(request)
    gateway = request.app[GATEWAY_KEY]
    own = worker_name(request)
    folder = os.environ.get(WORKER_SOCKETS_ENV, "")
    if local.status != 200 or not folder or not isinstance(local, web.Response) or local.body is None:
        return local  # refused (auth) or not under the supervisor: as a single gateway answers
    headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
    headers[FORWARDED_HEADER] = own
    others = await asyncio.to_thread(other_workers, folder, own)
    sources = {p.stem: p for p in others}
    snac_socket = gateway.config.snac_socket
    snac_expected = bool(snac_socket) and await asyncio.to_thread(metrics_socket_path(snac_socket).exists)
    if snac_expected:
        sources[SNAC_LABEL] = metrics_socket_path(snac_socket)  # the shared SNAC process: its decode passes

    async def fetch(name: str, path: Path) -> tuple[str, str | None]:
        try:
            async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path)),
                                             timeout=aiohttp.ClientTimeout(METRICS_FETCH_TIMEOUT_S)) as http, \
                    http.get(f"http://worker{METRICS_PATH}", headers=headers) as resp:
                return name, (await resp.text()) if resp.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, OSError):
            return name, None

    texts = {own: bytes(local.body).decode()}  # type: ignore[arg-type]
    texts.update({name: text for name, text in await asyncio.gather(*(fetch(n, p) for n, p in sources.items()))
                  if text})
    body = merge_worker_expositions(texts, expected=len(others) + 1,
                                    answered=sum(1 for name in texts if name != SNAC_LABEL),
                                    snac_answered=(SNAC_LABEL in texts) if snac_expected else None)
    response = web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})
    response.headers[WORKER_HEADER] = own
    return response
