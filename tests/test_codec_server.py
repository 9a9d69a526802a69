"""The shared SNAC decoder on a Unix socket: same audio as in-process decoding, requests of several clients in
one pass, clear errors for bad requests and a missing server."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gateway.orpheus import SAMPLES_PER_FRAME
from gateway.speech.codec import DecodeBatcher, SnacModel, StreamWindower, decode_windows
from gateway.speech.codec_server import (
    HEADER,
    SERVER_ENV,
    STATUS_ERROR,
    CodecClient,
    CodecServer,
    CodecServerSettings,
    codec_server_env,
)
from tests.support import first_window, make_frames, take_all


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
                                   cuda_graphs=False, window_lengths=(2, 3), max_batch=8)
    env = codec_server_env(settings)
    assert CodecServerSettings.from_env(env[SERVER_ENV]) == settings


@pytest.mark.parametrize(("overrides", "message"), [
    ({"snac_placement": "gpu"}, "snac_placement must be one of process, shared"),
    ({"snac_placement": "engine"}, "snac_placement must be one of process, shared"),
])
def test_bad_placements_are_refused(overrides: dict[str, object], message: str) -> None:
    from gateway.config import ConfigError, from_sources

    with pytest.raises(ConfigError, match=message):
        from_sources(env={}, **overrides)


def test_server_process_without_settings_exits_with_a_message() -> None:
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != SERVER_ENV}
    done = subprocess.run([sys.executable, "-m", "gateway.speech.codec_server"], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and f"{SERVER_ENV} is not set" in done.stderr
