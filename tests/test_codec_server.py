"""The shared SNAC decoder on a Unix socket, both protocols. Windows: same audio as in-process decoding, requests
of several clients in one pass. Streams: the same audio as the in-process streaming decoder, the streams of
several clients in one step, the synthesizer speaking through it. Both: clear errors for bad messages and a
missing server, and decoding resumes once the server is back."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import socket
import struct
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gateway.orpheus import SAMPLES_PER_FRAME, Frame
from gateway.speech.codec import DecodeBatcher, SnacModel, StreamWindower, decode_windows
from gateway.speech.codec_server import (
    ALL_STREAMS,
    CHUNK,
    END,
    ERROR,
    FINISH,
    HEADER,
    LAST,
    MESSAGE,
    OPEN,
    PUSH,
    PUSH_HEAD,
    RELEASE,
    SERVER_ENV,
    SERVER_POLL_S,
    STATUS_ERROR,
    STREAM_HELLO,
    CodecClient,
    CodecServer,
    CodecServerSettings,
    CodecStreamClient,
    StreamCodecServer,
    codec_server_env,
)
from gateway.speech.snac_stream import MAX_HEAD_FRAMES, StreamingSnac
from gateway.speech.stream_decoder import StreamDecoder
from gateway.speech.synthesizer import Synthesizer, UtteranceStats, uses_stream_decoder
from tests.support import decoded_audio, first_window, make_frames, take_all, wait_until


@pytest.fixture(scope="module")
def snac(tiny_snac_dir: Path) -> Iterator[SnacModel]:
    from snac.layers import NoiseBlock

    model = SnacModel.load(str(tiny_snac_dir), "cpu")
    for m in model.model.modules():  # SNAC adds fresh noise on every call; without it two decodes can be compared
        if isinstance(m, NoiseBlock):
            m.forward = lambda x: x  # type: ignore[method-assign]
    yield model


class GatedModel:
    """The real SNAC model whose first pass waits until the test lets it go, so requests pile up meanwhile."""

    def __init__(self, model: SnacModel) -> None:
        self.model = model
        self.entered = threading.Event()
        self.release = threading.Event()

    def decode_codes(self, codes: np.ndarray, frames: int) -> np.ndarray:
        self.entered.set()
        self.release.wait(timeout=30)
        return self.model.decode_codes(codes, frames)


@pytest.fixture
def server_path(tmp_path: Path) -> Path:
    return tmp_path / "snac.sock"


def start_server(model: object, path: Path, max_batch: int = 64) -> CodecServer:
    server = CodecServer(model, path, max_batch)  # type: ignore[arg-type]
    server.start()
    return server


def windows_of(lengths_seed: int) -> list:
    windower = StreamWindower(1, 1, 1)
    windower.push(make_frames(6, seed=lengths_seed))
    return [w for w in take_all(windower) if w.length == 3]


def test_client_decodes_as_the_model_does(snac: SnacModel, server_path: Path) -> None:
    server = start_server(snac, server_path)
    client = CodecClient(server_path)
    try:
        windows = windows_of(3)
        remote = decode_windows(client, windows)
        local = decode_windows(snac, windows)
        assert [len(p) for p in remote] == [SAMPLES_PER_FRAME] * len(windows)
        for a, b in zip(remote, local, strict=True):
            assert np.array_equal(a, b)
        first = first_window(make_frames(2, seed=5))  # another length on the same connection
        assert np.array_equal(decode_windows(client, [first])[0], decode_windows(snac, [first])[0])
    finally:
        client.close()
        server.close()
    assert not server_path.exists(), "the server removes its socket"


def test_requests_waiting_together_share_one_pass_and_get_their_own_rows(snac: SnacModel,
                                                                        server_path: Path) -> None:
    gated = GatedModel(snac)
    server = start_server(gated, server_path)
    clients = [CodecClient(server_path) for _ in range(3)]
    results: dict[int, list[np.ndarray]] = {}
    window_sets = [windows_of(10 + i) for i in range(3)]

    def call(i: int) -> None:
        results[i] = decode_windows(clients[i], window_sets[i])

    try:
        first = threading.Thread(target=call, args=(0,))
        first.start()
        assert gated.entered.wait(10)
        others = [threading.Thread(target=call, args=(i,)) for i in (1, 2)]
        for t in others:
            t.start()
        deadline = threading.Event()
        while server._queue.qsize() < 2 and not deadline.wait(0.01):  # both requests queued behind the first pass
            pass
        gated.release.set()
        for t in (first, *others):
            t.join(timeout=30)
        assert server.batches == 2, "the two requests that waited went through SNAC together"
        for i, windows in enumerate(window_sets):
            for got, want in zip(results[i], decode_windows(snac, windows), strict=True):
                assert np.array_equal(got, want)
    finally:
        gated.release.set()
        for c in clients:
            c.close()
        server.close()


def _raw_request(path: Path, payload: bytes) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(path))
        sock.sendall(payload)
        status, count = HEADER.unpack(sock.recv(HEADER.size, socket.MSG_WAITALL))
        body = sock.recv(count, socket.MSG_WAITALL) if status == STATUS_ERROR else b""
        try:
            rest = sock.recv(1)
        except ConnectionResetError:  # closed with our unread codes in its buffer
            rest = b""
        assert rest == b"", "the server closes a connection that broke the protocol"
        return status, body


@pytest.mark.parametrize(("frames", "rows", "codes", "message"), [
    (0, 1, [], "bad request: 0 frames"),
    (3, 65, [0] * 21 * 65, "1..64 rows"),
    (1, 1, [5000, 0, 0, 0, 0, 0, 0], "codes must be within 0..4095"),
    (1, 1, [-1, 0, 0, 0, 0, 0, 0], "codes must be within 0..4095"),
])
def test_bad_requests_get_an_error_and_the_server_goes_on(snac: SnacModel, server_path: Path, frames: int,
                                                          rows: int, codes: list[int], message: str) -> None:
    server = start_server(snac, server_path)
    try:
        status, body = _raw_request(server_path, HEADER.pack(frames, rows) + struct.pack(f"<{len(codes)}h", *codes))
        assert status == STATUS_ERROR and message in body.decode()
        client = CodecClient(server_path)
        assert len(decode_windows(client, windows_of(1))[0]) == SAMPLES_PER_FRAME, "other clients are served"
        client.close()
    finally:
        server.close()


def test_a_decode_error_is_reported_and_the_client_recovers(snac: SnacModel, server_path: Path) -> None:
    class Failing:
        calls = 0

        def decode_codes(self, codes: np.ndarray, frames: int) -> np.ndarray:
            Failing.calls += 1
            if Failing.calls == 1:
                raise ValueError("out of memory, say")
            return snac.decode_codes(codes, frames)

    server = start_server(Failing(), server_path)
    client = CodecClient(server_path)
    try:
        with pytest.raises(RuntimeError, match="SNAC decode failed: out of memory"):
            decode_windows(client, windows_of(2))
        assert len(decode_windows(client, windows_of(2))) == 4, "the next batch reconnects and decodes"
    finally:
        client.close()
        server.close()


async def test_without_a_server_a_batch_fails_clearly_and_decoding_resumes_when_it_is_back(
        snac: SnacModel, server_path: Path) -> None:
    batcher = DecodeBatcher(CodecClient(server_path, timeout_s=5), max_batch=8)
    try:
        window = first_window(make_frames(2, seed=7))
        with pytest.raises(RuntimeError, match=f"audio decoding failed: SNAC server at {server_path} unreachable"):
            await batcher.decode(window)
        server = start_server(snac, server_path)  # e.g. the engine core came back
        try:
            assert len(await batcher.decode(window)) == SAMPLES_PER_FRAME
            server.close()
            server = start_server(snac, server_path)  # restarted again: the old connection is dead
            assert len(await batcher.decode(window)) == SAMPLES_PER_FRAME, "retried once on a new connection"
            server.close()
            with pytest.raises(RuntimeError, match=r"audio decoding failed: SNAC server at .* unreachable"):
                await batcher.decode(window)  # gone for good: the retry fails too, with the reason
            server = start_server(snac, server_path)
        finally:
            server.close()
    finally:
        batcher.close()


def test_settings_travel_in_the_environment(tmp_path: Path) -> None:
    settings = CodecServerSettings(socket=str(tmp_path / "s.sock"), snac_model="x", snac_dtype="bfloat16",
                                   cuda_graphs=False, window_lengths=(2, 3), max_batch=8, decoder="windows",
                                   max_streams=96, compile=True)
    env = codec_server_env(settings)
    assert CodecServerSettings.from_env(env[SERVER_ENV]) == settings


@pytest.mark.parametrize(("overrides", "message"), [
    ({"snac_placement": "gpu"}, "snac_placement must be one of process, shared"),
    ({"snac_placement": "engine"}, "snac_placement must be one of process, shared"),
    ({"snac_compile": True, "snac_decoder": "windows"}, "snac_compile needs snac_decoder stream"),
])
def test_bad_placements_are_refused(overrides: dict[str, object], message: str) -> None:
    from gateway.config import ConfigError, from_sources

    with pytest.raises(ConfigError, match=message):
        from_sources(env={}, **overrides)


def test_server_process_without_settings_exits_with_a_message() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    done = subprocess.run([sys.executable, "-m", "gateway.cluster.snac_process"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and f"{SERVER_ENV} is not set" in done.stderr


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


async def decode_stream(decoder: StreamDecoder | CodecStreamClient, frames: list[Frame],
                        pieces: Sequence[int] = (1, 3, 2)) -> np.ndarray:
    """One sentence's audio from a streaming decoder: frames pushed a few at a time, then finished."""
    stream = decoder.open(lambda: 0.0)
    sizes = itertools.cycle(pieces)
    at = 0
    while at < len(frames):
        step = next(sizes)
        decoder.push(stream, frames[at:at + step])
        at += step
    decoder.finish(stream)
    try:
        return await decoded_audio(stream.chunks)
    finally:
        decoder.release(stream)


async def test_streams_through_the_server_sound_as_in_process(snac_weights: Any, server_path: Path) -> None:
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    client = CodecStreamClient(server_path)
    local = StreamDecoder(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS))
    try:
        # One stream at a time on both: their noise seeds come from the same counter.
        for count, seed in ((12, 1), (2, 2), (5, 3)):
            frames = make_frames(count, seed=seed)
            remote = await decode_stream(client, frames)
            here = await decode_stream(local, frames)
            assert len(remote) == count * SAMPLES_PER_FRAME, "every frame's audio once"
            assert np.array_equal(remote, here), "the same samples as the in-process streaming decoder"
        free = server.decoder.snac._free
        await wait_until(lambda: len(free) == STREAM_SLOTS)
    finally:
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
        second = clients[1].open(lambda: 0.0)
        clients[1].push(second, make_frames(frames, seed=2))
        await wait_until(lambda: server.decoder._commands.qsize() >= 2)  # its open and push wait behind the step
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
    return _message(PUSH, stream_id, PUSH_HEAD.pack(0, lookahead) + struct.pack(f"<{len(codes)}h", *codes))


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
    (_message(PUSH, 1, PUSH_HEAD.pack(0, 2)), "message kind 2 with 8 payload bytes"),  # no frames
    (MESSAGE.pack(PUSH, 1, 1 << 31), "message kind 2 with 2147483648 payload bytes"),  # refused before it is read
    (_message(FINISH, 1), "message kind 3 with 0 payload bytes"),
], ids=["unknown-kind", "open-with-payload", "push-without-frames", "oversized", "finish-without-lead"])
def test_a_connection_that_breaks_the_stream_protocol_gets_an_error_and_others_go_on(
        snac_weights: Any, server_path: Path, message: bytes, error: str) -> None:
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    try:
        with _stream_connection(server_path) as sock:
            sock.sendall(_message(OPEN, 1) + message)
            kind, stream_id, text = _read_message(sock)
            assert (kind, stream_id) == (ERROR, ALL_STREAMS) and error in text.decode()
            assert _closed(sock), "the server closes a connection that broke the protocol"
        free = server.decoder.snac._free
        deadline = threading.Event()
        while len(free) < STREAM_SLOTS and not deadline.wait(0.01):  # its open stream was released
            pass
        with _stream_connection(server_path) as sock:  # another connection is served
            sock.sendall(_message(OPEN, 2) + _push(2, list(range(7))) + _message(FINISH, 2, struct.pack("<i", 0)))
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
                _message(FINISH, 4, struct.pack("<i", 250)),
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
        deadline = threading.Event()
        while len(free) < STREAM_SLOTS and not deadline.wait(0.01):  # the closed connection's streams released
            pass
        assert len(free) == STREAM_SLOTS
    finally:
        server.close()
    assert not server_path.exists(), "the server removes its socket"


async def test_each_protocol_says_so_to_a_client_of_the_other(snac: SnacModel, snac_weights: Any,
                                                              server_path: Path) -> None:
    server = start_stream_server(StreamingSnac(snac_weights, "cpu", max_streams=STREAM_SLOTS), server_path)
    try:
        with pytest.raises(RuntimeError, match="SNAC server: this SNAC server decodes streams"):
            decode_windows(CodecClient(server_path), windows_of(1))
    finally:
        server.close()
    windows_server = start_server(snac, server_path)
    client = CodecStreamClient(server_path)
    try:
        with pytest.raises(RuntimeError, match=r"does not serve streams .*bad request"):
            await decode_stream(client, make_frames(3, seed=1))
    finally:
        client.close()
        windows_server.close()


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
    assert uses_stream_decoder(config) and not uses_stream_decoder(dataclasses.replace(config, snac_decoder="windows"))
    decoder = Synthesizer.load(config).decoder
    assert isinstance(decoder, CodecStreamClient), "snac_socket with snac_decoder stream: the shared stream decoder"
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
