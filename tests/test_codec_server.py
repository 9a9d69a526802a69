"""The shared SNAC decoder on a Unix socket: the same audio as the in-process streaming decoder, the streams of
several clients in one step, the synthesizer speaking through it; clear errors for bad messages, for a peer that
does not speak the protocol and for a missing server, and decoding resumes once the server is back."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import os
import socket
import struct
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.orpheus import SAMPLES_PER_FRAME, Frame
from gateway.speech.codec.client import SERVER_POLL_S, CodecStreamClient
from gateway.speech.codec.server import SERVER_ENV, CodecServerSettings, StreamCodecServer, codec_server_env
from gateway.speech.codec.wire import (
    ALL_STREAMS,
    CHUNK,
    END,
    ERROR,
    FINISH,
    LAST,
    LEAD,
    MESSAGE,
    OPEN,
    PUSH,
    PUSH_HEAD,
    RELEASE,
    STREAM_HELLO,
)
from gateway.speech.decoder import Decoder, DecoderSettings
from gateway.speech.snac import MAX_HEAD_FRAMES, StreamingSnac
from gateway.speech.stream_decoder import StreamDecoder
from gateway.speech.synthesizer import Synthesizer, UtteranceStats
from tests.support import ManualClock, decoded_audio, make_frames, poll_until, wait_until


@pytest.fixture
def server_path(tmp_path: Path) -> Path:
    return tmp_path / "snac.sock"


def test_settings_travel_in_the_environment(tmp_path: Path) -> None:
    settings = CodecServerSettings(socket=str(tmp_path / "s.sock"), decoder=DecoderSettings(
        snac_model="x", snac_dtype="bfloat16", cuda_graphs=False, max_batch=8, max_streams=96, compile=True))
    env = codec_server_env(settings)
    assert CodecServerSettings.from_env(env[SERVER_ENV]) == settings


@pytest.mark.parametrize(("overrides", "message"), [
    ({"snac_placement": "gpu"}, "snac_placement must be one of process, shared"),
    ({"snac_placement": "engine"}, "snac_placement must be one of process, shared"),
    ({"snac_mps_priority": "low"}, "snac_mps_priority must be one of normal, below-normal"),
    ({"snac_mps_priority": "below-normal"}, "below-normal needs the shared SNAC process of --workers"),
    ({"snac_mps_priority": "below-normal", "workers": 2, "snac_placement": "process"},
     "below-normal needs the shared SNAC process of --workers"),
])
def test_bad_placements_are_refused(overrides: dict[str, object], message: str) -> None:
    from gateway.config import ConfigError, from_sources

    with pytest.raises(ConfigError, match=message):
        from_sources(env={}, **overrides)


def test_below_normal_priority_reaches_the_snac_process_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--snac-mps-priority below-normal`: the shared SNAC process starts with CUDA_MPS_CLIENT_PRIORITY=1 (below
    normal under an MPS daemon); `vllm serve` and the workers keep the normal priority (the processes are not
    started here)."""
    from gateway.cluster.addressing import WORKER_CONFIG_ENV, WORKER_SOCKETS_ENV
    from gateway.cluster.supervisor import MPS_CLIENT_PRIORITY_ENV, Supervisor
    from gateway.config import GatewayConfig, from_sources, validate

    monkeypatch.delenv(MPS_CLIENT_PRIORITY_ENV, raising=False)
    monkeypatch.setenv(WORKER_SOCKETS_ENV, str(tmp_path))
    for priority, want in (("below-normal", "1"), ("normal", None)):
        config = from_sources(env={}, workers=2, snac_mps_priority=priority)
        children = {child.name: child for child in Supervisor(config, 2).children}
        assert children["snac server"].env.get(MPS_CLIENT_PRIORITY_ENV) == want
        assert MPS_CLIENT_PRIORITY_ENV not in children["vllm serve"].env
        assert MPS_CLIENT_PRIORITY_ENV not in children["worker 0"].env
        worker = GatewayConfig(**json.loads(children["worker 0"].env[WORKER_CONFIG_ENV]))
        validate(worker)  # a worker owns no SNAC process: its own setting is normal
        assert worker.snac_mps_priority == "normal"


@pytest.mark.parametrize(("settings", "message"), [
    (None, f"{SERVER_ENV} is not set"),
    ('{"socket": "/tmp/x.sock", "snac_model": "x"}', f"{SERVER_ENV} is not CodecServerSettings JSON"),  # flat
    ("{not json", f"{SERVER_ENV} is not CodecServerSettings JSON"),
])
def test_server_process_without_valid_settings_exits_with_a_message(settings: str | None, message: str) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV} | ({SERVER_ENV: settings} if settings else {})
    done = subprocess.run([sys.executable, "-m", "gateway.cluster.snac_process"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


# --- the stream protocol ------------------------------------------------------------------------------------

STREAM_SLOTS = 8


@pytest.fixture(scope="module")
def snac_weights(tiny_snac_dir: Path) -> Any:
    from snac import SNAC

    return SNAC.from_pretrained(str(tiny_snac_dir)).eval()


class GatedStreamingSnac(StreamingSnac):
    """The real streaming decoder whose first step waits until the test lets it go, so commands pile up meanwhile."""

    def __init__(self, model: Any) -> None:
        super().__init__(model, "cpu", max_streams=STREAM_SLOTS)
        self.entered = threading.Event()
        self.go = threading.Event()

    def step_batch(self, handles: Sequence[Any], *, as_float: bool = False) -> list[np.ndarray]:
        self.entered.set()
        self.go.wait(timeout=30)
        return super().step_batch(handles, as_float=as_float)


def start_stream_server(snac: StreamingSnac, path: Path, **decoder_options: Any) -> StreamCodecServer:
    server = StreamCodecServer(StreamDecoder(snac, **decoder_options), path)
    server.start()
    return server


def pushes(frames: list[Frame], pieces: Sequence[int] = (1, 3, 2)) -> list[list[Frame]]:
    """The frames cut into pushes of a few at a time, `pieces` frames each in turn."""
    cut, at, sizes = [], 0, itertools.cycle(pieces)
    while at < len(frames):
        size = next(sizes)
        cut.append(frames[at:at + size])
        at += size
    return cut


async def decode_stream(decoder: Decoder, frames: list[Frame]) -> np.ndarray:
    """One sentence's audio from a streaming decoder: frames pushed a few at a time (`pushes`), then finished."""
    stream = decoder.open(lambda: 0.0)
    for piece in pushes(frames):
        decoder.push(stream, piece)
    decoder.finish(stream)
    try:
        return await decoded_audio(stream.chunks)
    finally:
        decoder.release(stream)


async def decode_all_at_once(decoder: Decoder, worker: StreamDecoder,
                             gated: GatedStreamingSnac, frames: list[Frame]) -> np.ndarray:
    """`decode_stream`, with every command of the sentence waiting in `worker`'s queue before it acts on any: a
    blocker stream holds the worker in its first step meanwhile. What a decoder sees at each tick then no longer
    depends on thread timing (a loaded machine could let it bridge from the first 4 frames on one side and from 8
    on the other)."""
    gated.go.clear()
    gated.entered.clear()
    blocker = decoder.open(lambda: 0.0)
    decoder.push(blocker, make_frames(1, seed=99))
    assert await asyncio.to_thread(gated.entered.wait, 30), "the blocker's step holds the worker"
    sent = worker.commands_sent
    decoding = asyncio.ensure_future(decode_stream(decoder, frames))
    commands = 2 + len(pushes(frames))  # open, the pushes and finish
    await wait_until(lambda: worker.commands_sent >= sent + commands)
    gated.go.set()
    try:
        return await decoding
    finally:
        decoder.release(blocker)


async def test_streams_through_the_server_sound_as_in_process(snac_weights: Any, server_path: Path) -> None:
    remote_snac, local_snac = GatedStreamingSnac(snac_weights), GatedStreamingSnac(snac_weights)
    server = start_stream_server(remote_snac, server_path)
    client = CodecStreamClient(server_path)
    local = StreamDecoder(local_snac)
    try:
        # One sentence at a time on both (each after its blocker): their noise seeds come from the same counter.
        for count, seed in ((12, 1), (2, 2), (5, 3)):
            frames = make_frames(count, seed=seed)
            remote = await decode_all_at_once(client, server.decoder, remote_snac, frames)
            here = await decode_all_at_once(local, local, local_snac, frames)
            assert len(remote) == count * SAMPLES_PER_FRAME, "every frame's audio once"
            assert np.array_equal(remote, here), "the same samples as the in-process streaming decoder"
        free = server.decoder.snac._free
        await wait_until(lambda: len(free) == STREAM_SLOTS)
    finally:
        remote_snac.go.set()
        local_snac.go.set()
        client.close()
        local.close()
        server.close()


async def test_streams_of_two_clients_share_one_step(snac_weights: Any, server_path: Path) -> None:
    gated = GatedStreamingSnac(snac_weights)
    frames = MAX_HEAD_FRAMES + 4  # more than the bridge can decode: the exact stream must step both streams
    steps: list[int] = []
    server = start_stream_server(gated, server_path, on_batch=lambda streams, *_: steps.append(streams))
    clients = [CodecStreamClient(server_path) for _ in range(2)]
    try:
        first = clients[0].open(lambda: 0.0)
        clients[0].push(first, make_frames(frames, seed=1))
        assert await asyncio.to_thread(gated.entered.wait, 30), "the first client's stream is stepping"
        sent = server.decoder.commands_sent
        second = clients[1].open(lambda: 0.0)
        clients[1].push(second, make_frames(frames, seed=2))
        await wait_until(lambda: server.decoder.commands_sent >= sent + 2)  # its open and push wait behind the step
        gated.go.set()
        for client, stream in zip(clients, (first, second), strict=True):
            client.finish(stream)
        for stream in (first, second):
            assert len(await decoded_audio(stream.chunks)) == frames * SAMPLES_PER_FRAME
        assert 2 in steps, "one step decoded the streams of both clients"
    finally:
        gated.go.set()
        for client in clients:
            client.close()
        server.close()


def _stream_connection(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(STREAM_HELLO)
    assert sock.recv(len(STREAM_HELLO), socket.MSG_WAITALL) == STREAM_HELLO
    return sock


def _message(kind: int, stream_id: int, payload: bytes = b"") -> bytes:
    return MESSAGE.pack(kind, stream_id, len(payload)) + payload


def _push(stream_id: int, codes: list[int], lookahead: int = 1) -> bytes:
    return _message(PUSH, stream_id, PUSH_HEAD.pack(0, lookahead, 1) + struct.pack(f"<{len(codes)}h", *codes))


def _read_message(sock: socket.socket) -> tuple[int, int, bytes]:
    kind, stream_id, size = MESSAGE.unpack(sock.recv(MESSAGE.size, socket.MSG_WAITALL))
    return kind, stream_id, sock.recv(size, socket.MSG_WAITALL) if size else b""


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:  # closed with our unread bytes in its buffer
        return True


@pytest.mark.parametrize(("message", "error"), [
    (_message(9, 1), "unknown message kind 9"),
    (_message(OPEN, 1, b"xxxx"), "message kind 1 with 4 payload bytes"),
    (_message(PUSH, 1, PUSH_HEAD.pack(0, 2, 1)), "message kind 2 with 12 payload bytes"),  # no frames
    (MESSAGE.pack(PUSH, 1, 1 << 31), "message kind 2 with 2147483648 payload bytes"),  # refused before it is read
    (_message(FINISH, 1), "message kind 3 with 0 payload bytes"),
], ids=["unknown-kind", "open-with-payload", "push-without-frames", "oversized", "finish-without-lead"])
def test_a_connection_that_breaks_the_stream_protocol_gets_an_error_and_others_go_on(
        snac_weights: Any, server_path: Path, message: bytes, error: str) -> None:
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    try:
        with _stream_connection(server_path) as sock:
            sock.sendall(_message(OPEN, 1) + _push(1, list(range(7))) + message)  # stream 1 holds a slot
            kind, stream_id, text = _read_message(sock)
            assert (kind, stream_id) == (ERROR, ALL_STREAMS) and error in text.decode()
            assert _closed(sock), "the server closes a connection that broke the protocol"
        free = server.decoder.snac._free
        poll_until(lambda: len(free) == STREAM_SLOTS, "its open stream was released")
        with _stream_connection(server_path) as sock:  # another connection is served
            sock.sendall(_message(OPEN, 2) + _push(2, list(range(7))) + _message(FINISH, 2, LEAD.pack(0, 1)))
            assert _read_message(sock)[0] == CHUNK
    finally:
        server.close()


def test_a_bad_stream_fails_alone_and_its_connection_goes_on(snac_weights: Any, server_path: Path) -> None:
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    try:
        with _stream_connection(server_path) as sock:
            sock.sendall(b"".join([
                _message(OPEN, 1), _push(1, [5000, 0, 0, 0, 0, 0, 0]),  # a code out of range
                _push(7, [0] * 7),  # never opened
                _message(OPEN, 2), _message(OPEN, 2),  # opened twice
                _message(OPEN, 3), _push(3, [0] * 7, lookahead=8),
                _message(RELEASE, 8),  # releasing an unknown stream is nothing
                _message(OPEN, 4), _push(4, list(itertools.chain(*make_frames(2, seed=4)))),
                _message(FINISH, 4, LEAD.pack(250, 0)),
            ]))
            errors: dict[int, str] = {}
            samples = 0
            while (message := _read_message(sock))[0] != END:
                kind, stream_id, payload = message
                if kind == ERROR:
                    errors[stream_id] = payload.decode()
                else:
                    assert (kind, stream_id) == (CHUNK, 4)
                    samples += (len(payload) - LAST.size) // 2
            assert message[1] == 4 and samples == 2 * SAMPLES_PER_FRAME, "the good stream on the same connection"
            assert "codes in [0, 4096)" in errors[1]
            assert errors[7] == "stream 7 is not open"
            assert errors[2] == "stream 2 is open already"
            assert "lookahead in [0, 7]" in errors[3]
            assert set(errors) == {1, 2, 3, 7}
        free = server.decoder.snac._free
        poll_until(lambda: len(free) == STREAM_SLOTS, "the closed connection's streams released")
    finally:
        server.close()
    assert not server_path.exists(), "the server removes its socket"


async def test_each_end_says_so_to_a_peer_that_does_not_speak_the_protocol(snac_weights: Any,
                                                                           server_path: Path) -> None:
    """A server answers a client that does not open with STREAM_HELLO with a connection error and closes; a client
    whose server answers anything else fails its stream with what it got."""
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(10)
            sock.connect(str(server_path))
            sock.sendall(b"SNACWIN1")
            kind, stream_id, text = _read_message(sock)
            assert (kind, stream_id) == (ERROR, ALL_STREAMS)
            assert text.decode() == f"not a SNAC stream client: it began with b'SNACWIN1', not {STREAM_HELLO!r}"
            assert _closed(sock)
    finally:
        server.close()

    async def answer_otherwise(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(len(STREAM_HELLO))
        writer.write(b"HELLO!!!")
        await writer.drain()
        writer.close()

    other = await asyncio.start_unix_server(answer_otherwise, str(server_path))
    client = CodecStreamClient(server_path)
    try:
        with pytest.raises(RuntimeError, match=r"does not serve SNAC streams: it answered b'HELLO!!!'"):
            await decode_stream(client, make_frames(3, seed=1))
    finally:
        client.close()
        other.close()
        await other.wait_closed()


async def test_a_stopped_server_fails_open_streams_and_the_next_stream_works_once_it_is_back(
        snac_weights: Any, server_path: Path) -> None:
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    client = CodecStreamClient(server_path, connect_timeout_s=5)
    try:
        stream = client.open(lambda: 0.0)
        client.push(stream, make_frames(4, seed=1))
        assert isinstance(await stream.chunks.get(), tuple), "audio came"
        server.close()  # the process died or restarts
        while isinstance(item := await stream.chunks.get(), tuple):
            pass
        assert isinstance(item, RuntimeError)
        assert str(item) == f"audio decoding failed: SNAC server at {server_path} closed the connection"
        client.release(stream)
        with pytest.raises(RuntimeError, match=f"audio decoding failed: SNAC server at {server_path} unreachable"):
            await decode_stream(client, make_frames(3, seed=2))
        server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
        assert len(await decode_stream(client, make_frames(3, seed=2))) == 3 * SAMPLES_PER_FRAME
    finally:
        client.close()
        server.close()


@pytest.mark.engine
async def test_the_synthesizer_speaks_through_the_shared_stream_decoder(synthesizer: Synthesizer, snac_weights: Any,
                                                                       server_path: Path) -> None:
    config = dataclasses.replace(synthesizer.config, snac_socket=str(server_path))
    decoder = Synthesizer.load(config).decoder
    assert isinstance(decoder, CodecStreamClient), "snac_socket: a client of the shared stream decoder"
    remote = Synthesizer(config, synthesizer.engine, synthesizer.tokenizer, decoder)
    assert synthesizer.engine.ready and not remote.ready, "not ready while the SNAC process does not listen"
    waiting = asyncio.create_task(remote.wait_for_decoder())
    await asyncio.sleep(3 * SERVER_POLL_S)
    assert not waiting.done()
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    await asyncio.wait_for(waiting, timeout=10)
    assert remote.ready, "ready once it listens; the probe's connection does not disturb the server"
    try:
        stats = UtteranceStats()
        chunks = [c async for c in remote.utterance("Spoken through the socket. Twice!", "tara", seed=4,
                                                    stats=stats)]
        assert stats.sentences == 2 and {c.sentence_index for c in chunks} == {0, 1}
        assert stats.frames > 0 and stats.samples == stats.frames * SAMPLES_PER_FRAME
        assert chunks[-1].last_of_sentence and server.decoder.stats.batches > 0
        server.close()  # whether the client has seen its connection close yet or not: the sentence fails clearly
        gone = r"audio decoding failed: SNAC server at .* (unreachable|closed the connection)"
        with pytest.raises(RuntimeError, match=gone):
            async for _ in remote.utterance("Nobody decodes this.", "tara", seed=5):
                pass
        await wait_until(lambda: synthesizer.engine.in_flight == 0)
    finally:
        decoder.close()
        server.close()


def test_a_waiting_listeners_lead_holds_until_its_audio_is_sent() -> None:
    """The server's model of a client's lead: reported as not running (the listener waits for this stream's first
    audio), it stays as reported; from the first audio sent it runs down in real time; a running lead runs down
    from its report."""
    from gateway.speech.codec.server import _ClientLead

    clock = ManualClock(100.0)
    lead = _ClientLead(clock=clock)
    lead.report(0, runs=False)
    clock.advance(0.05)
    assert lead() == 0.0, "a lead reported as not running holds"
    lead.sent(2400)  # 100 ms of audio: the listener starts playing it
    assert lead() == pytest.approx(0.1), "the first audio sent starts the run-down from now"
    clock.advance(0.03)
    assert lead() == pytest.approx(0.07), "100 ms sent, 30 ms played"
    lead.report(200, runs=True)
    clock.advance(0.05)
    assert lead() == pytest.approx(0.15), "a running report runs down from when it came"
    lead.sent(1200)
    assert lead() == pytest.approx(0.2), "audio sent to a running listener adds to its lead"
