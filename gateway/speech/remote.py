"""Generation on `vllm serve` servers: the interface of `gateway.speech.engine.OrpheusEngine`, over HTTP.

`RemoteEngine` sends each prompt to one of the configured OpenAI-compatible vLLM servers as
`POST {url}/v1/completions` (prompt = token ids, `stream: true`, `return_token_ids: true`) and yields the
generated ids of each streamed chunk, exactly as the in-process engine yields its DELTA outputs.

* Routing: the healthy server with the fewest streams from this gateway; ties take turns.
* Health: every `engine_health_interval_s` each server's `GET /health` is checked (and its model name learnt from
  `GET /v1/models`). A server that fails a check, refuses a connection, answers a server error or breaks a stream is
  taken out; new utterances go to the others; it comes back once it answers its check. The engine is READY while at
  least one server is in.
* Cancel: closing the iterator closes the request's HTTP connection; vLLM aborts a request whose client went away,
  which frees its sequence slot at once.

Run the servers with `--skip-tokenizer-init`: the gateway tokenizes, and the server then does not detokenize.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from gateway.config import GatewayConfig
from gateway.model_table import LoraAdapter
from gateway.speech.engine import (
    WARMUP_PROMPT,
    WARMUP_TOKENS,
    EngineBase,
    EngineState,
    sampling_settings,
    warm_up_ladder,
    warmup_sizes,
)
from gateway.speech.errors import (
    EngineDeadError,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    ServerUnusableError,
)

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 5.0  # a server that cannot answer /health this fast is no use for real-time speech
CONNECT_TIMEOUT_S = 5.0
# An idle pooled connection is dropped before `vllm serve` drops it (uvicorn's keep-alive, vLLM's
# VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s), or requests meet connections the server is closing and "Server
# disconnected" takes a healthy server out (docs/decisions/remote-engine.md).
KEEPALIVE_S = 4.0
# Finish reasons of a request that ran to its end; "abort" means the server dropped it (e.g. shutting down).
NORMAL_FINISH = frozenset({"stop", "length"})
# HTTP statuses that say the request itself is wrong, not the server: retrying elsewhere would fail the same way.
REQUEST_ERROR_STATUSES = frozenset({400, 413, 422})


@dataclass(eq=False)  # identity semantics: servers are kept in sets
class RemoteServer:
    """One `vllm serve` server as this gateway sees it."""

    url: str
    healthy: bool | None = None  # None until the first check
    model: str | None = None  # served model name, learnt from /v1/models once healthy
    in_flight: int = 0  # streams from this gateway open now (the routing load)
    requests: int = 0  # streams sent here so far
    taken_out: int = 0  # times it was taken out of routing
    last_error: str | None = None
    warmed_up: bool = False  # the start-up bursts ran since it (re)joined


class RemoteEngine(EngineBase):
    """Token streams from one or more `vllm serve` servers, with least-loaded routing and failover."""

    def __init__(self, config: GatewayConfig, on_state: Callable[[EngineState], None] | None = None) -> None:
        if not config.vllm_urls:
            raise ValueError("RemoteEngine needs at least one vllm_urls entry")
        super().__init__(config, on_state)
        self.servers = [RemoteServer(url.rstrip("/")) for url in config.vllm_urls]
        self._id_prefix = f"orpheus-{secrets.token_hex(6)}"  # unique across gateway processes sharing a server
        self._turn = 0
        self._was_ready = False
        self._session: aiohttp.ClientSession | None = None
        self._responses: set[aiohttp.ClientResponse] = set()
        self._headers = {"Authorization": f"Bearer {config.vllm_api_key}"} if config.vllm_api_key else {}

    # --- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        """Check every server once, then keep checking in the background; READY as soon as one answers."""
        self._set_state(EngineState.STARTING)
        self._session = aiohttp.ClientSession(
            # sock_read bounds the silence between chunks: a host that vanished without closing its sockets.
            timeout=aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S,
                                          sock_read=self.config.vllm_read_timeout_s),
            # One connection per stream: aiohttp's default cap (100) would queue streams beyond it.
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            headers=self._headers)
        await self._check_all()
        if not self.ready:
            log.warning("no vLLM server answers yet (%s); ready once one does",
                        ", ".join(f"{s.url}: {s.last_error}" for s in self.servers))
        self._watchdog = asyncio.create_task(self._watch(), name="remote-engine-health")

    async def close(self) -> None:
        self._set_state(EngineState.CLOSED)
        await self._stop_watchdog()
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    def unfinished_requests(self) -> int:
        """Streams still open to a server (vLLM aborts a request once its connection is closed)."""
        return len(self._responses)

    # --- health -----------------------------------------------------------------------------------
    async def _watch(self) -> None:
        while self.state is not EngineState.CLOSED:
            await asyncio.sleep(self.config.engine_health_interval_s)
            try:
                await self._check_all()
            except Exception:  # the loop must outlive any surprise, or readiness would freeze
                log.exception("vLLM health check failed")

    async def _check_all(self) -> None:
        await asyncio.gather(*(self._check(server) for server in self.servers))

    async def _check(self, server: RemoteServer) -> None:
        session = self._session
        if session is None:
            return
        timeout = aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
        try:
            async with await _send(session, "GET", f"{server.url}/health", timeout=timeout) as response:
                if response.status != 200:
                    raise ServerUnusableError(f"/health answered {response.status}")
            if server.model is None:
                server.model = await self._served_model(session, server, timeout)
            if not server.warmed_up:
                await self._warm_up(session, server)
        except (TimeoutError, aiohttp.ClientError, ServerUnusableError) as exc:
            self._take_out(server, _describe(exc))
            return
        self._put_back(server)

    async def _warm_up(self, session: aiohttp.ClientSession, server: RemoteServer) -> None:
        """The in-process engine's start-up bursts (`warmup_batch_sizes`), before the server takes users: a
        fresh `vllm serve` JIT-compiles its sampling kernels on first use, seconds per new batch size
        (docs/decisions/remote-engine.md). Runs again after the server comes back."""
        async def one(size: int, i: int) -> None:
            body = self._request_body(WARMUP_PROMPT, f"{self._id_prefix}-warmup-{size}-{i}", WARMUP_TOKENS, None, 0)
            response = await self._post(session, server, body)
            try:
                await response.read()
            finally:
                response.release()

        async def burst(size: int) -> None:
            await asyncio.gather(*(one(size, i) for i in range(size)))

        sizes = warmup_sizes(self.config)  # the server's device is not known here: the time budget bounds it
        try:
            self.warmed_up = await warm_up_ladder(sizes, burst, f"vLLM server {server.url}")
        except EngineRequestError as exc:  # refused (a server setting): warming up cannot fix it; serve anyway
            log.warning("vLLM server %s refused the warm-up: %s", server.url, exc)
        server.warmed_up = True

    async def _served_model(self, session: aiohttp.ClientSession, server: RemoteServer,
                            timeout: aiohttp.ClientTimeout) -> str:
        async with session.get(f"{server.url}/v1/models", timeout=timeout) as response:
            if response.status in (401, 403):
                raise ServerUnusableError(f"/v1/models answered {response.status}: check vllm_api_key")
            if response.status != 200:
                raise ServerUnusableError(f"/v1/models answered {response.status}")
            served = [m["id"] for m in (await response.json()).get("data", [])]
        wanted = self.config.vllm_model
        if wanted is None and served:
            return served[0]
        if wanted in served:
            return wanted
        raise ServerUnusableError(f"serves {served}, not {wanted!r} (vllm_model)")

    def _take_out(self, server: RemoteServer, reason: str) -> None:
        if server.healthy is not False:  # log changes only, not every failed check
            log.warning("vLLM server %s taken out: %s", server.url, reason)
        if server.healthy is True:
            server.taken_out += 1
        server.healthy = False
        server.model = None  # learn it again when the server is back: it may have been restarted with another
        server.warmed_up = False
        server.last_error = reason
        self._update_state()

    def _put_back(self, server: RemoteServer) -> None:
        if server.healthy is not True:
            log.info("vLLM server %s is in (model %s)", server.url, server.model)
        server.healthy = True
        server.last_error = None
        self._update_state()

    def _update_state(self) -> None:
        if self.state in (EngineState.STOPPED, EngineState.CLOSED):
            return
        up = any(s.healthy for s in self.servers)
        if up and self.state is not EngineState.READY:
            if self._was_ready:
                self.restarts += 1  # before the state change: the server's on_state counts restarts on READY
            self._was_ready = True
            self._set_state(EngineState.READY)
        elif not up and self.state is EngineState.READY:
            self._set_state(EngineState.RESTARTING)

    # --- routing ----------------------------------------------------------------------------------
    def _pick(self, tried: set[RemoteServer]) -> RemoteServer | None:
        """The healthy server with the fewest open streams from this gateway; ties take turns."""
        candidates = [s for s in self.servers if s.healthy and s.model is not None and s not in tried]
        if not candidates:
            return None
        least = min(s.in_flight for s in candidates)
        ties = [s for s in candidates if s.in_flight == least]
        self._turn += 1
        return ties[self._turn % len(ties)]

    # --- generation -------------------------------------------------------------------------------
    def _request_body(self, prompt_ids: Sequence[int], request_id: str, max_tokens: int | None, seed: int | None,
                      priority: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "stream": True,
            "return_token_ids": True,  # each chunk carries its new ids in choices[0].token_ids
            "stream_interval": self.config.stream_interval,  # raises (never lowers) the server's --stream-interval
            "request_id": request_id,
        }
        body.update({k: v for k, v in sampling_settings(self.config, max_tokens, seed).items() if v is not None})
        if priority:  # a server without priority scheduling refuses any other value than the default
            body["priority"] = priority
        return body

    async def _post(self, session: aiohttp.ClientSession, server: RemoteServer,
                    body: dict[str, Any]) -> aiohttp.ClientResponse:
        """Open the stream on `server`; `ServerUnusableError` when another server should get the request."""
        try:
            response = await _send(session, "POST", f"{server.url}/v1/completions",
                                   json={"model": server.model, **body})
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise ServerUnusableError(f"connection failed: {_describe(exc)}") from exc
        if response.status == 200:
            return response
        try:
            message = await _error_message(response)
        finally:
            response.release()
        if response.status in REQUEST_ERROR_STATUSES:
            raise EngineRequestError(f"the vLLM server refused the request: {message}")
        raise ServerUnusableError(f"answered {response.status}: {message}")

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None,
                       seed: int | None = None, priority: int = 0,
                       lora: LoraAdapter | None = None) -> AsyncIterator[list[int]]:
        """Stream the ids a server generates for one prompt, a chunk at a time (DELTA lists).

        Closing or cancelling the iterator closes the connection, which aborts the request on the server.
        """
        session = self._session
        if not self.ready or session is None:
            raise EngineUnavailableError(f"engine is {self.state.value}")
        request_id = f"{self._id_prefix}-{next(self._ids)}"
        body = self._request_body(prompt_ids, request_id, max_tokens, seed, priority)
        if lora is not None:  # a server started with --lora-modules serves the adapter under its name
            body["model"] = lora.name
        self._in_flight.add(request_id)
        self.requests_started += 1
        tried: set[RemoteServer] = set()
        try:
            # Fail over only before the first chunk: once ids went out, a retry elsewhere would repeat audio.
            while True:
                server = self._pick(tried)
                if server is None:
                    raise EngineUnavailableError("no vLLM server is available: " + "; ".join(
                        f"{s.url}: {s.last_error or 'not checked yet'}" for s in self.servers))
                tried.add(server)
                server.in_flight += 1
                server.requests += 1
                try:
                    response = await self._post(session, server, body)
                except ServerUnusableError as exc:
                    server.in_flight -= 1
                    self._take_out(server, str(exc))
                    continue
                except BaseException:
                    server.in_flight -= 1
                    raise
                break
            self._responses.add(response)
            complete = False
            try:
                async with contextlib.aclosing(self._read(server, response)) as chunks:
                    async for ids in chunks:
                        yield ids
                complete = True
            finally:
                server.in_flight -= 1
                self._responses.discard(response)
                if complete:
                    response.release()  # keep the connection for the next request
                else:
                    response.close()  # consumer went away (cancel, barge-in): vLLM aborts on disconnect
                    self.requests_aborted += 1
        finally:
            self._in_flight.discard(request_id)

    async def _read(self, server: RemoteServer, response: aiohttp.ClientResponse) -> AsyncIterator[list[int]]:
        """The ids of each server-sent event until the request finishes; EngineError when it cannot."""
        finished = False
        while True:
            try:
                line = await response.content.readline()
            except (TimeoutError, aiohttp.ClientError) as exc:
                self._take_out(server, f"stream broke: {_describe(exc)}")
                raise EngineDeadError(f"the vLLM server {server.url} stopped during this request") from exc
            if not line:
                break
            if not line.startswith(b"data:"):
                continue  # blank separators between events
            payload = line[5:].strip()
            if payload == b"[DONE]":
                continue  # the body ends right after; reading to its end lets the connection be reused
            try:
                event = json.loads(payload)
            except ValueError as exc:
                raise EngineError(f"the vLLM server {server.url} sent an unreadable event: {payload[:100]!r}") from exc
            if "error" in event:
                raise self._stream_error(server, event)
            for choice in event.get("choices") or ():
                if choice.get("token_ids"):
                    yield choice["token_ids"]
                reason = choice.get("finish_reason")
                if reason is not None:
                    if reason not in NORMAL_FINISH:
                        raise EngineDeadError(f"the vLLM server {server.url} ended this request ({reason})")
                    finished = True
        if not finished:
            self._take_out(server, "a stream ended before its request finished")
            raise EngineDeadError(f"the vLLM server {server.url} stopped during this request")

    def _stream_error(self, server: RemoteServer, event: dict[str, Any]) -> EngineError:
        """An error event inside the stream: vLLM sends one when the request fails after its 200, with an HTTP
        status as `code`. A status of a wrong request (REQUEST_ERROR_STATUSES, as before the 200): this request was
        wrong. Anything else is the server failing, most often its engine core dying (vLLM then shuts the API server
        down): out of rotation until its health checks pass, and the utterance ends `engine_dead`, as when the
        stream breaks."""
        text = _error_text(event)
        error = event.get("error")
        code = error.get("code") if isinstance(error, dict) else None
        if code in REQUEST_ERROR_STATUSES:
            return EngineRequestError(f"the vLLM server refused the request: {text}")
        self._take_out(server, f"failed a request mid-stream: {text}")
        return EngineDeadError(f"the vLLM server {server.url} failed during this request: {text}")


async def _error_message(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    try:
        return _error_text(json.loads(text))
    except ValueError:
        return text[:300]


def _error_text(body: Any) -> str:
    """vLLM's error bodies: `{"error": {"message": ...}}` (some versions: `{"message": ...}`)."""
    if isinstance(body, dict):
        error = body.get("error", body)
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])[:300]
    return str(body)[:300]


async def _send(session: aiohttp.ClientSession, method: str, url: str, **kwargs: Any) -> aiohttp.ClientResponse:
    """A request; one that meets a pooled connection the server closed as the request went out (no answer, or a
    reset) goes once more on a new connection. The server dropped it unanswered: a completion it had begun is
    aborted with its connection, so the second one is not a duplicate."""
    try:
        return await session.request(method, url, **kwargs)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        if isinstance(exc, aiohttp.ClientConnectorError):  # no connection was made: nothing stale to retry
            raise
        log.info("%s %s: %s on a pooled connection; sending it again", method, url, _describe(exc))
        return await session.request(method, url, **kwargs)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
