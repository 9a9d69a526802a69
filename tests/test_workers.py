"""`serve --workers 2` against the real `vllm serve` (tiny model, CPU): two processes on one port, sessions
sticky to the worker that answered the offer, requests about a session passed to its owner, a killed worker
restarted, everything stopped by SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cluster.addressing import (
    FORWARDED_HEADER,
    SNAC_SOCKET_NAME,
    WORKER_HEADER,
    WORKER_INDEX_ENV,
    WORKER_SOCKETS_ENV,
    socket_path,
)
from gateway.devtools.client import HeadlessPeer
from gateway.edge.http import OFFER_PATH
from tests.support import (
    RECORD_STATES_JS,
    TEST_MAX_TOKENS,
    VllmServer,
    chromium,
    free_port,
    needs_chromium,
    offer_sdp,
    poll_until,
    reached,
    start_process_group,
    stop_process_group,
    wait_until,
)

pytestmark = pytest.mark.engine

WORKERS = 2
START_TIMEOUT_S = 240.0  # two workers load tokenizer + SNAC on 2 busy cores
MAX_PEERS = 16  # connect until both workers hold sessions (the kernel spreads connections by hash)
MAX_SESSIONS = 8  # gateway-wide: 4 a worker, so a test can fill one
MAX_IN_FLIGHT = MAX_PEERS  # utterances, gateway-wide: each worker counts the others' (every peer may speak at once)


class Workers:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, sockets: Path, log: Path) -> None:
        self.proc, self.port, self.sockets, self.log = proc, port, sockets, log

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http(self, index: int) -> aiohttp.ClientSession:
        """A client of worker `index`'s own Unix socket (URLs: http://worker/...)."""
        return aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(socket_path(self.sockets, index))))

    def worker_pids(self, module: str = "gateway.cluster.workers") -> list[int]:
        """Live workers, or other children running `module` (a killed one is a zombie until the supervisor's
        next poll reaps it)."""
        pids = []
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):  # gone or a zombie meanwhile
                if child.status() != psutil.STATUS_ZOMBIE and module in " ".join(child.cmdline()):
                    pids.append(child.pid)
        return pids

    def worker_pid(self, index: int) -> int:
        """The live worker `index`."""
        (pid,) = [pid for pid in self.worker_pids()
                  if psutil.Process(pid).environ().get(WORKER_INDEX_ENV) == str(index)]
        return pid

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    async def wait_all_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Each worker's own Unix socket answers /readyz with 200."""
        deadline = time.monotonic() + timeout
        for index in range(WORKERS):
            path = socket_path(self.sockets, index)
            while True:
                assert self.proc.poll() is None, f"supervisor exited:\n{self.log_tail()}"
                assert time.monotonic() < deadline, f"worker {index} not ready:\n{self.log_tail()}"
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path))) as http, \
                            http.get("http://worker/readyz") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(0.5)


def _start_workers(vllm_server: VllmServer, model_dir: Path, snac_dir: Path, root: Path) -> Workers:
    sockets = root / "sockets"
    sockets.mkdir()
    port = free_port()
    cmd = [sys.executable, "-m", "gateway", "serve", "--workers", str(WORKERS), "--vllm-url", vllm_server.url,
           "--host", "127.0.0.1", "--port", str(port), "--model", str(model_dir),
           "--snac-model", str(snac_dir), "--snac-device", "cpu", "--max-tokens", str(TEST_MAX_TOKENS),
           # the server's own settings (conftest): each worker warms it up once, with a burst it can batch
           "--max-num-seqs", str(vllm_server.config.max_num_seqs), "--warmup-batch-sizes", "2",
           "--jitter-buffer-ms", "0", "--log-level", "warning", "--max-sessions", str(MAX_SESSIONS),
           "--max-in-flight-utterances", str(MAX_IN_FLIGHT),
           "--snac-placement", "shared",  # one SNAC process decodes for all workers (gateway.cluster.snac_process)
           # lines sent with `cache: true` only (no other test sends it): the host's on-disk phrase cache
           "--phrase-cache", "marked", "--phrase-cache-dir", str(root / "phrases")]
    log = root / "serve.log"
    proc = start_process_group(cmd, {**os.environ, WORKER_SOCKETS_ENV: str(sockets)}, log)
    return Workers(proc, port, sockets, log)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
async def workers(vllm_server: VllmServer, tiny_model_dir: Path, tiny_snac_dir: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Workers]:
    root = tmp_path_factory.mktemp("workers")
    running = _start_workers(vllm_server, tiny_model_dir, tiny_snac_dir, root)
    proc = running.proc
    try:
        await running.wait_all_ready()
        yield running
    finally:
        stop_process_group(proc)


async def _delete(http: aiohttp.ClientSession, url: str, session_id: str) -> tuple[int, dict[str, str]]:
    async with http.delete(f"{url}/v1/webrtc/sessions/{session_id}") as resp:
        await resp.read()
        return resp.status, dict(resp.headers)


async def test_sessions_spread_over_workers_speak_and_end_through_any_worker(workers: Workers) -> None:
    peers: list[HeadlessPeer] = []
    try:
        while len({p.session_id[:3] for p in peers if p.session_id}) < WORKERS and len(peers) < MAX_PEERS:
            peer = HeadlessPeer(workers.url, jitter_buffer_ms=0)
            peers.append(peer)
            await peer.connect(timeout=60)
        owners = {p.session_id.split("-")[0] for p in peers if p.session_id}
        assert owners == {"w0", "w1"}, f"sessions all on {owners} after {len(peers)} peers"

        for i, peer in enumerate(peers):
            peer.speak(f"s{i}", "Good morning.")
        for i, peer in enumerate(peers):
            done = await peer.wait_event("done", f"s{i}", timeout=120)
            assert done["audio_ms"] > 0
            assert peer.audible_frames(), f"peer {i} heard nothing"

        # A session of worker 1 ended through worker 0's own socket: passed on to worker 1.
        w1_session = next(p.session_id for p in peers if p.session_id and p.session_id.startswith("w1-"))
        async with workers.http(0) as http:
            status, headers = await _delete(http, "http://worker", w1_session)
            assert (status, headers[WORKER_HEADER], headers[FORWARDED_HEADER]) == (204, "w1", "w0")
            again, _ = await _delete(http, "http://worker", w1_session)
            assert again == 404
            unknown, _ = await _delete(http, "http://worker", "w7-0123abcd")  # no such worker
            assert unknown == 404
        async with aiohttp.ClientSession() as http:  # the rest through the public port, wherever they land
            for peer in peers:
                if peer.session_id != w1_session:
                    status, _ = await _delete(http, workers.url, peer.session_id or "")
                    assert status == 204
    finally:
        await asyncio.gather(*(p.close() for p in peers), return_exceptions=True)

    # Metrics from any worker cover all: each sample labelled with its worker, both workers' sessions counted.
    async with aiohttp.ClientSession() as http, http.get(f"{workers.url}/metrics") as resp:
        assert resp.status == 200
        families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
    opened = {s.labels["worker"]: s.value for s in families["orpheus_sessions"].samples if s.name.endswith("_total")}
    assert set(opened) == {"w0", "w1"} and sum(opened.values()) >= len(peers)
    answered = {s.labels["state"]: s.value for s in families["orpheus_metrics_workers"].samples}
    assert answered == {"answered": WORKERS, "expected": WORKERS}
    # ... and the shared SNAC process's decode passes, which it made for both workers' sessions.
    passes = {s.labels["worker"]: s.value for s in families["orpheus_snac_batch_size"].samples
              if s.name.endswith("_count")}
    assert passes["snac"] > 0 and passes.get("w0", 0) == 0 and passes.get("w1", 0) == 0, passes
    # ... and the first audios it decoded, with their holds (`gateway.benchmarks.run --gateway-url` reads them there)
    starts: dict[str, float] = {}  # by worker, summed over where the audio came from (exact stream or bridge)
    for sample in families["orpheus_snac_first_audio_hold_seconds"].samples:
        if sample.name.endswith("_count"):
            starts[sample.labels["worker"]] = starts.get(sample.labels["worker"], 0.0) + sample.value
    assert starts.get("snac", 0) > 0 and starts.get("w0", 0) == starts.get("w1", 0) == 0, starts


async def test_an_offer_a_full_worker_cannot_take_goes_to_a_worker_that_can(workers: Workers) -> None:
    """Offers all sent to worker 0's own socket: once it has no session slot left, it passes them on to worker 1
    (answered there, marked as passed on; a WHEP player's too, with its Location). Once both are full, the offer
    gets 503 `at_capacity` with its Retry-After, counted once among the refusals. Every session then ends through
    the public port."""
    async def offer() -> tuple[int, dict[str, str], dict[str, Any]]:
        async with workers.http(0) as http, \
                http.post(f"http://worker{OFFER_PATH}", json={"sdp": await offer_sdp(), "type": "offer"}) as r:
            return r.status, dict(r.headers), await r.json()

    async def whep_offer() -> tuple[int, dict[str, str]]:  # SDP in and out
        async with workers.http(0) as http, \
                http.post("http://worker/whep", data=(await offer_sdp()).encode(),
                          headers={"Content-Type": "application/sdp"}) as r:
            await r.read()
            return r.status, dict(r.headers)

    async def refused() -> float:  # at_capacity refusals so far, every worker's
        async with aiohttp.ClientSession() as http, http.get(f"{workers.url}/metrics") as resp:
            families = {f.name: f for f in text_string_to_metric_families(await resp.text())}
        return sum(s.value for s in families["orpheus_rejections"].samples
                   if s.name.endswith("_total") and s.labels.get("code") == "at_capacity")

    answered: list[tuple[dict[str, str], dict[str, Any]]] = []
    whep_session: str | None = None
    refused_before = await refused()
    try:
        while len(answered) + (whep_session is not None) <= MAX_SESSIONS:
            status, headers, body = await offer()
            if status != 200:
                break
            answered.append((headers, body))
            if whep_session is None and body["session_id"].startswith("w1-"):  # worker 0 is full: WHEP too
                whep_status, whep_headers = await whep_offer()
                assert whep_status == 201, whep_headers
                assert whep_headers["Content-Type"].startswith("application/sdp")
                assert (whep_headers[WORKER_HEADER], whep_headers[FORWARDED_HEADER]) == ("w1", "w0")
                whep_session = whep_headers["Location"].removeprefix("/whep/")
                assert whep_session.startswith("w1-"), whep_headers["Location"]
        assert status == 503 and body["error"]["code"] == "at_capacity" and int(headers["Retry-After"]) > 0, body
        assert 0 < len(answered) < MAX_SESSIONS and whep_session is not None
        passed_on = [(h, b) for h, b in answered if b["session_id"].startswith("w1-")]
        assert passed_on, "worker 0 took every offer: it never ran full"
        assert all(h[WORKER_HEADER] == "w1" and h[FORWARDED_HEADER] == "w0" and b["sdp"] for h, b in passed_on)
        # worker 0 answered its own until it was full, then passed on every one after
        owners = [b["session_id"][:2] for _, b in answered]
        assert owners == sorted(owners), owners
        assert await refused() == refused_before + 1  # one client refused: counted once, not once per worker
    finally:
        async with aiohttp.ClientSession() as http:
            ended = [b["session_id"] for _, b in answered] + ([whep_session] if whep_session else [])
            for session_id in ended:
                status, _ = await _delete(http, workers.url, session_id)
                assert status == 204


async def test_workers_share_the_phrase_cache_of_their_host(workers: Workers, vllm_server: VllmServer) -> None:
    """`--phrase-cache marked`: a line sent with `cache: true` through worker 0 is played by worker 1 from the host's
    on-disk cache (one SQLite file), the same samples, without an engine request."""
    body = {"input": "Shared by the workers of a host.", "response_format": "pcm", "cache": True}
    async with workers.http(0) as http, http.post("http://worker/v1/audio/speech", json=body) as resp:
        assert resp.status == 200
        made = await resp.read()
    database = workers.sockets.parent / "phrases" / "phrases.sqlite3"

    def stored() -> bool:
        with contextlib.closing(sqlite3.connect(database)) as db, contextlib.suppress(sqlite3.OperationalError):
            return db.execute("SELECT count(*) FROM phrases").fetchone()[0] == 1
        return False

    poll_until(stored, "worker 0 did not store the line")
    before = await vllm_server.metric("vllm:request_success_total")
    async with workers.http(1) as http, http.post("http://worker/v1/audio/speech", json=body) as resp:
        assert resp.status == 200
        assert await resp.read() == made
    assert await vllm_server.metric("vllm:request_success_total") == before


async def test_a_burst_of_first_requests_to_both_workers_makes_one_engine_request(
        workers: Workers, vllm_server: VllmServer) -> None:
    """Identical first requests (`cache: true`) to both workers at once: one worker claims the line's lease on the
    host's board and asks vllm serve once; the other follows its relayed chunks; every body has the same samples."""
    body = {"input": "Both workers start this line together.", "response_format": "pcm", "cache": True}

    async def speak(index: int) -> bytes:
        async with workers.http(index) as http, http.post("http://worker/v1/audio/speech", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()

    before = await vllm_server.metric("vllm:request_success_total")
    bodies = await asyncio.gather(*(speak(index) for index in (0, 1) * 3))
    assert len(bodies[0]) > 0 and all(b == bodies[0] for b in bodies)
    assert await vllm_server.metric("vllm:request_success_total") == before + 1
    async with aiohttp.ClientSession() as http, http.get(f"{workers.url}/metrics") as resp:  # every worker's
        text = await resp.text()
    joins = sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
                if sample.name == "orpheus_phrase_cache_single_flight_joins_total")
    assert joins >= 5  # every request but the leader's followed it, in its worker or through the board


async def test_a_killed_leader_worker_lets_the_follower_make_the_line(workers: Workers) -> None:
    """Worker 0 leads a line (its lease on the host's board), worker 1 follows it; worker 0 is killed: its lease
    expires, worker 1 makes the line itself (its own stream ends with the final marker) and its request ends with
    audio, not an error."""
    body = {"input": "This line outlives the worker that started it.", "response_format": "pcm", "cache": True}
    database = workers.sockets.parent / "phrases" / "phrases.sqlite3"
    leader, follower = workers.worker_pid(0), workers.worker_pid(1)

    def rows(query: str) -> list[tuple[Any, ...]]:  # none before the workers made the database
        with contextlib.suppress(sqlite3.OperationalError), contextlib.closing(sqlite3.connect(database)) as db:
            return db.execute(query).fetchall()
        return []

    async def speak(index: int) -> bytes:
        async with workers.http(index) as http, http.post("http://worker/v1/audio/speech", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()

    first = asyncio.create_task(speak(0))
    try:
        def leading() -> list[str]:
            return [k for (k, owner) in rows("SELECT key, owner FROM flights") if f":{leader}:" in owner]

        await wait_until(lambda: bool(leading()), timeout=60, message="worker 0 did not claim the line")
        (key,) = leading()
        second = asyncio.create_task(speak(1))
        deadline = time.monotonic() + 30
        while not any(heard > 0 for (heard,) in rows("SELECT heard FROM flights")):  # worker 1 follows
            assert time.monotonic() < deadline and not second.done(), "worker 1 did not follow the leader"
            await asyncio.sleep(0.01)
        os.kill(leader, signal.SIGKILL)
        made = await asyncio.wait_for(second, 120)
        assert len(made) > 0
        def finals() -> list[str]:  # the streams of the line that ended with its entry stored
            return [owner for (k, owner) in rows("SELECT key, owner FROM flight_chunks WHERE final = 1") if k == key]

        await wait_until(lambda: any(f":{follower}:" in owner for owner in finals()), timeout=30,
                         message="worker 1 did not make the line")
        assert not any(f":{leader}:" in owner for owner in finals()), finals()  # worker 0 never finished it
    finally:
        with contextlib.suppress(Exception):
            await first
    deadline = time.monotonic() + START_TIMEOUT_S  # the supervisor restarts worker 0
    while len(workers.worker_pids()) < WORKERS or leader in workers.worker_pids():
        assert time.monotonic() < deadline, f"worker 0 was not restarted:\n{workers.log_tail()}"
        await asyncio.sleep(0.5)
    await workers.wait_all_ready()


async def test_utterances_count_against_one_limit_across_workers(workers: Workers) -> None:
    """Speech requests held open on worker 0: it takes more than half the gateway-wide limit (before, each worker
    had half), worker 1 takes the rest, and the next one gets 503 `at_capacity` there; once they end, worker 1
    speaks again."""
    text = " ".join(f"Sentence number {i} keeps this request speaking." for i in range(12))  # long past the test
    held: list[tuple[aiohttp.ClientSession, aiohttp.ClientResponse]] = []

    async def speak(index: int) -> aiohttp.ClientResponse:  # returns at its first audio (200), or its refusal
        http = workers.http(index)
        resp = await http.post("http://worker/v1/audio/speech", json={"input": text, "response_format": "pcm"})
        held.append((http, resp))
        return resp

    on_w0 = MAX_IN_FLIGHT // 2 + 1
    try:
        first = await asyncio.gather(*(speak(0) for _ in range(on_w0)))
        assert [r.status for r in first] == [200] * on_w0, [r.status for r in first]
        rest = await asyncio.gather(*(speak(1) for _ in range(MAX_IN_FLIGHT - on_w0)))
        assert [r.status for r in rest] == [200] * len(rest), [r.status for r in rest]
        refused = await speak(1)
        body = await refused.json()
        assert refused.status == 503 and body["error"]["code"] == "at_capacity", body
        assert int(refused.headers["Retry-After"]) > 0
    finally:
        for http, resp in held:
            resp.close()
            await http.close()
    deadline = time.monotonic() + 60  # the closed requests end once the server notices (aborted in vLLM)
    while True:
        async with workers.http(1) as http, \
                http.post("http://worker/v1/audio/speech", json={"input": "Again.", "response_format": "pcm"}) as r:
            if r.status == 200:
                assert len(await r.read()) > 0
                break
            assert r.status == 503 and time.monotonic() < deadline, (r.status, await r.text())
        await asyncio.sleep(0.5)


@pytest.mark.browser
@needs_chromium
async def test_the_page_reconnects_by_itself_when_its_worker_is_killed(workers: Workers) -> None:
    """The avatar page in Chromium, its session's worker killed (SIGKILL closes nothing: the server just stops
    answering): the page notices, says so, comes back by itself to a live worker and speaks again."""
    pytest.importorskip("playwright.async_api")
    speech_ms = 120_000  # a phrase on the shared 2-core CPU
    try:
        async with chromium() as browser:
            page = await browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(f"{workers.url}/?reconnect_base_ms=300")
            await page.fill("#jitter", "0")
            await page.click("#connect")
            await page.wait_for_selector('body[data-state="ready"]', timeout=60_000)
            await page.locator(".phrase").first.click()
            await page.wait_for_selector('#now[data-kind="done"]', timeout=speech_ms)
            lost_id = await page.evaluate("window.__app.connection.sessionId")
            # What the page says the moment it starts reconnecting, recorded in the page: with 300 ms to the next
            # attempt it can be connected again (its error box cleared) before a second read from here.
            await page.evaluate(RECORD_STATES_JS)
            os.kill(workers.worker_pid(int(lost_id.split("-")[0].removeprefix("w"))), signal.SIGKILL)

            said = await reached(page, "reconnecting", timeout_s=30)
            assert "stopped answering" in said["error"], said
            assert said["now"].startswith("Reconnecting"), said
            await page.wait_for_selector('body[data-state="ready"]', timeout=60_000)
            assert (await page.text_content("#now")).startswith("Connected again")
            assert await page.evaluate("window.__app.connection.sessionId") != lost_id
            await page.locator(".phrase").nth(1).click()
            await page.wait_for_selector('#now[data-kind="done"]', timeout=speech_ms)
            assert not errors, f"uncaught errors in the page: {errors}"
    finally:
        await workers.wait_all_ready()  # the killed worker restarted, for the tests after this one


async def test_a_killed_worker_is_restarted(workers: Workers) -> None:
    before = workers.worker_pids()
    assert len(before) == WORKERS
    os.kill(before[0], signal.SIGKILL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(set(workers.worker_pids()) - set(before)) < 1:
        assert time.monotonic() < deadline, f"no new worker:\n{workers.log_tail()}"
        await asyncio.sleep(0.5)
    await workers.wait_all_ready()
    async with aiohttp.ClientSession() as http, http.get(f"{workers.url}/readyz") as resp:
        assert resp.status == 200


async def test_one_snac_process_decodes_for_every_worker_and_is_restarted(workers: Workers) -> None:
    """--snac-placement shared: the workers load no SNAC; one `gateway.cluster.snac_process` child decodes for both
    (the sessions test above spoke through it). Killed, it is restarted and speech goes on."""
    (snac_pid,) = workers.worker_pids("gateway.cluster.snac_process")
    assert (workers.sockets / SNAC_SOCKET_NAME).is_socket()
    os.kill(snac_pid, signal.SIGKILL)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not (restarted := [p for p in workers.worker_pids("gateway.cluster.snac_process") if p != snac_pid]):
        assert time.monotonic() < deadline, f"no new SNAC server:\n{workers.log_tail()}"
        await asyncio.sleep(0.5)
    peer = HeadlessPeer(workers.url, jitter_buffer_ms=0)
    try:
        await peer.connect(timeout=60)
        for attempt in itertools.count():  # until the new server listens, an utterance fails with an error event
            assert time.monotonic() < deadline, f"no speech after the SNAC server restarted:\n{workers.log_tail()}"
            uid = f"again{attempt}"
            peer.speak(uid, "Good morning.")
            while not (ended := peer.find("done", uid) + peer.find("error", uid)):
                assert time.monotonic() < deadline, f"utterance {uid} never ended:\n{workers.log_tail()}"
                await asyncio.sleep(0.1)
            event = ended[0].message
            if event["type"] == "done":
                assert event["audio_ms"] > 0
                break
            assert event["code"] == "synthesis_failed" and "SNAC server" in event["message"], event
            await asyncio.sleep(1)
        assert workers.worker_pids("gateway.cluster.snac_process") == restarted, \
            f"the restarted SNAC server spoke and stayed up (one, not restarted again):\n{workers.log_tail()}"
    finally:
        await peer.close()


def test_bench_against_the_running_workers(workers: Workers, tmp_path: Path) -> None:
    """`bench --gateway-url --gateway-pid`: the WebRTC level against a gateway in other processes, clients in
    their own; each point splits the gateway's CPU by process and reads SNAC's batching from its /metrics."""
    from gateway.benchmarks.run import main

    out = tmp_path / "bench"
    argv = ["--gateway-url", workers.url, "--gateway-pid", str(workers.proc.pid), "--quick", "--scenario",
            "streaming", "--streaming-users", "2", "--client-processes", "2", "--warmup", "0", "--no-plots",
            "--out", str(out)]
    assert main(argv) == 0
    run = json.loads((out / "bench.json").read_text())
    (point,) = run["scenarios"][0]["points"]
    assert run["gateway_url"] == workers.url and run["scenarios"][0]["level"] == "webrtc"
    assert point["summary"]["ok"] == 2 and all(r["audio_s"] > 0 for r in point["requests"])
    pipeline = point["pipeline"]
    assert pipeline["cpu_s"]["client_processes"] > 0
    assert pipeline["server"]["cpu_s"]["worker"] > 0 and pipeline["server"]["cpu_s"]["snac"] > 0
    # the shared SNAC process decoded both users' audio: its steps, seen through the workers' merged /metrics
    assert pipeline["snac"]["batches"] > 0 and pipeline["snac"]["new_frames"] > 0
    # every worker's event loop and the SNAC process's streams loop reported their lag over the point
    assert pipeline["workers_loop_lag"]["samples"] > 0 and pipeline["snac_loop_lag"]["samples"] > 0

def test_fault_bench_kills_the_snac_process_and_every_utterance_ends_once(workers: Workers, tmp_path: Path) -> None:
    """`benchmarks.faults` against the running workers, the SNAC fault (seconds; a killed worker's peers take ~30 s of
    ICE consent checks to notice, too long here): peers keep speaking through the kill, every utterance ends
    exactly once, no session is lost, and new sessions speak again."""
    from gateway.benchmarks.faults import main

    out = tmp_path / "faults"
    argv = ["--gateway-url", workers.url, "--supervisor-pid", str(workers.proc.pid), "--sockets",
            str(workers.sockets), "--faults", "snac", "--peers", "2", "--client-processes", "1", "--before-s", "3",
            "--after-s", "16", "--out", str(out)]
    assert main(argv) == 0, (out / "faults.json").read_text()
    (phase,) = json.loads((out / "faults.json").read_text())["phases"]
    assert phase["killed"]["kind"] == "snac" and phase["sessions"] == 2
    assert phase["silent"] == 0 and phase["doubled"] == 0 and phase["out_of_order"] == 0
    assert phase["sessions_lost"] == 0 and phase["ended_by_lost_connection"] == 0
    assert phase["new_session_speaking_after_s"] is not None and phase["done_after_fault"] > 0
    assert "| snac (snac) | 2 |" in (out / "faults.md").read_text()


async def test_sigterm_stops_the_supervisor_and_its_workers(workers: Workers) -> None:
    pids = workers.worker_pids() + workers.worker_pids("gateway.cluster.snac_process")
    assert len(pids) == WORKERS + 1
    workers.proc.send_signal(signal.SIGTERM)
    assert workers.proc.wait(timeout=60) == 0
    assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
    assert not list(workers.sockets.iterdir())


async def test_children_stop_when_the_supervisor_is_killed(vllm_server: VllmServer, tiny_model_dir: Path,
                                                           tiny_snac_dir: Path, tmp_path: Path) -> None:
    """SIGKILL gives the supervisor no chance to stop its children; they stop themselves (PR_SET_PDEATHSIG), so
    no orphaned worker keeps serving the port."""
    running = _start_workers(vllm_server, tiny_model_dir, tiny_snac_dir, tmp_path)
    children: list[int] = []
    try:
        await running.wait_all_ready()
        children = running.worker_pids() + running.worker_pids("gateway.cluster.snac_process")
        assert len(children) == WORKERS + 1
        running.proc.kill()
        running.proc.wait(timeout=30)
        deadline = time.monotonic() + START_TIMEOUT_S
        while alive := [pid for pid in children if _running(pid)]:
            assert time.monotonic() < deadline, f"{alive} outlived the supervisor:\n{running.log_tail()}"
            await asyncio.sleep(0.5)
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(running.proc.pid, signal.SIGKILL)
