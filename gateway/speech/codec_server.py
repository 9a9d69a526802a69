"""SNAC decoding served over a Unix socket: one decoder for every gateway process on a host.

Why: every process that runs CUDA kernels has its own CUDA context, and the GPU time-slices between contexts
instead of running their kernels side by side. With SNAC in each gateway worker and the model in vLLM's
engine-core process, generation slowed 2x at 384 streams on an H200 (docs/benchmarks.md). A `CodecServer` is
one context and one batch for all workers (`--snac-placement shared`: `python -m gateway.speech.codec_server`,
started by the supervisor; measured: fewer underruns than a decoder per worker). Running it inside vLLM's
engine-core process instead (a vLLM plugin, sharing the model's CUDA context) measured slower at every load on an
H200 and was removed: the GPU runs the sum of both workloads wherever SNAC is placed (docs/benchmarks.md).

Wire format (little-endian), one request in flight per connection:
  request  u32 frames, u32 rows, then rows x 7*frames int16 codes (rows of `orpheus.windows_to_layer_codes`)
  reply    u32 status 0, u32 rows, then rows x frames*2048 int16 PCM
           u32 status 1, u32 n, then n bytes of UTF-8 error text
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import shutil
import signal
import socket
import struct
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gateway.orpheus import CODEBOOK_SIZE, LAYER_CODES_PER_FRAME, SAMPLES_PER_FRAME
from gateway.speech.codec import SnacModel, batches_by_length, drain, own_stream

log = logging.getLogger(__name__)

HEADER = struct.Struct("<II")
STATUS_OK, STATUS_ERROR = 0, 1
CODES_PER_FRAME = sum(LAYER_CODES_PER_FRAME)
CLOSE_TIMEOUT_S = 10.0
MAX_FRAMES = 64  # longest window a request may carry (the gateway's are 2-6 frames)
SERVER_ENV = "ORPHEUS_GATEWAY_SNAC_SERVER"  # CodecServerSettings as JSON, set by the supervisor


@dataclass(frozen=True)
class CodecServerSettings:
    """What a codec server needs; the supervisor hands it to the SNAC process in SERVER_ENV."""

    socket: str
    snac_model: str
    device: str = "auto"
    snac_dtype: str = "float32"
    cuda_graphs: bool = True
    window_lengths: tuple[int, ...] = (2, 3, 4, 5, 6)
    max_batch: int = 256

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> CodecServerSettings:
        values = json.loads(text)
        values["window_lengths"] = tuple(values["window_lengths"])
        return cls(**values)


class ProtocolError(RuntimeError):
    """A peer sent something that is not a request or reply of this protocol."""


def _recv_exact(sock: socket.socket, size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("connection closed")
        got += n
    return buf


@dataclass
class _Request:
    conn: socket.socket
    frames: int
    codes: np.ndarray  # [rows, 7 * frames] int64


class CodecServer:
    """Decodes the requests of all connections; requests waiting together share one pass per window length.

    One reader thread per connection (a handful of gateway workers), one decode thread (as `DecodeBatcher`:
    whatever arrived while a pass ran goes into the next).
    """

    def __init__(self, model: SnacModel, path: str | Path, max_batch: int = 256) -> None:
        self.model = model
        self.path = Path(path)
        self.max_batch = max_batch
        self.batches = 0
        self._queue: queue.SimpleQueue[_Request | None] = queue.SimpleQueue()
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @classmethod
    def load(cls, settings: CodecServerSettings) -> CodecServer:
        model = SnacModel.load(settings.snac_model, settings.device, settings.snac_dtype)
        if settings.cuda_graphs:
            model.capture_graphs(settings.window_lengths, settings.max_batch)
        return cls(model, settings.socket, settings.max_batch)

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a server of an earlier engine process
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(self.path))
        listener.listen()
        self._listener = listener
        self._threads = [threading.Thread(target=self._accept, name="snac-server-accept", daemon=True),
                         threading.Thread(target=self._decode_loop, name="snac-server-decode", daemon=True)]
        for thread in self._threads:
            thread.start()
        log.info("SNAC decoding served on %s", self.path)

    def close(self) -> None:
        self._closed.set()
        self._queue.put(None)
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        self.path.unlink(missing_ok=True)
        for thread in self._threads:  # a decode in progress finishes first
            thread.join(timeout=CLOSE_TIMEOUT_S)

    def _accept(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._read, args=(conn,), name="snac-server-conn", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        try:
            while True:
                frames, rows = HEADER.unpack(_recv_exact(conn, HEADER.size))
                if not (1 <= frames <= MAX_FRAMES and 1 <= rows <= self.max_batch):
                    raise ProtocolError(f"bad request: {frames} frames x {rows} rows "
                                        f"(1..{MAX_FRAMES} frames, 1..{self.max_batch} rows)")
                raw = _recv_exact(conn, rows * CODES_PER_FRAME * frames * 2)
                codes = np.frombuffer(raw, dtype="<i2").reshape(rows, CODES_PER_FRAME * frames).astype(np.int64)
                if codes.min() < 0 or codes.max() >= CODEBOOK_SIZE:
                    raise ProtocolError(f"codes must be within 0..{CODEBOOK_SIZE - 1}")
                self._queue.put(_Request(conn, frames, codes))
        except ProtocolError as exc:
            _send_error(conn, str(exc))
        except (ConnectionError, OSError):
            pass
        with self._lock:
            self._conns.discard(conn)
        conn.close()

    def _decode_loop(self) -> None:
        with own_stream(getattr(self.model, "device", "cpu")):
            self._decode_requests()

    def _decode_requests(self) -> None:
        while (first := self._queue.get()) is not None:
            waiting, closing = drain(self._queue, first)
            for frames, group in batches_by_length(waiting, lambda r: r.frames, lambda r: len(r.codes),
                                                   self.max_batch):
                self._decode(frames, group)
            if closing or self._closed.is_set():
                return

    def _decode(self, frames: int, group: list[_Request]) -> None:
        try:
            pcm = self.model.decode_codes(np.concatenate([r.codes for r in group]), frames)
        except Exception as exc:  # one bad batch fails its requests, not the server
            log.exception("SNAC decode failed for %d requests", len(group))
            for request in group:
                _send_error(request.conn, f"SNAC decode failed: {exc}")
            return
        self.batches += 1
        at = 0
        for request in group:
            rows = len(request.codes)
            with contextlib.suppress(OSError):  # a client gone meanwhile: its reader thread cleans up
                request.conn.sendall(HEADER.pack(STATUS_OK, rows) + pcm[at:at + rows].astype("<i2").tobytes())
            at += rows


def _send_error(conn: socket.socket, message: str) -> None:
    data = message.encode()
    with contextlib.suppress(OSError):
        conn.sendall(HEADER.pack(STATUS_ERROR, len(data)) + data)


class CodecClient:
    """Stands in for `SnacModel` in `DecodeBatcher`: decodes on a `CodecServer`. Blocking; one call at a time
    (the batcher's thread). A lost connection fails that batch and is reopened by the next."""

    def __init__(self, path: str | Path, timeout_s: float = 10.0, own_folder: bool = False) -> None:
        """`own_folder`: the socket's folder was made for it alone and goes at close (the server that made the
        socket may be killed without removing it)."""
        self.path = str(path)
        self.timeout_s = timeout_s
        self.own_folder = own_folder
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(self.path)
            except OSError as exc:
                sock.close()
                raise ConnectionError(f"SNAC server at {self.path} unreachable: {exc}") from exc
            self._sock = sock
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def release(self) -> None:
        """Close for good (DecodeBatcher.close): the connection, and the socket's own folder if it has one."""
        self.close()
        if self.own_folder:
            shutil.rmtree(Path(self.path).parent, ignore_errors=True)

    def decode_codes(self, codes: np.ndarray, frames: int) -> np.ndarray:
        """int16 PCM [rows, frames * 2048] of `codes` ([rows, 7 * frames], `windows_to_layer_codes`)."""
        request = HEADER.pack(frames, len(codes)) + codes.astype("<i2").tobytes()
        reused = self._sock is not None
        try:
            return self._exchange(request, frames)
        except OSError:  # ConnectionError included
            if not reused:
                raise
        # The connection was opened before and broke meanwhile (the server restarted): once more on a new one.
        # Decoding is idempotent, so a request the old server may have half-processed is safe to repeat.
        return self._exchange(request, frames)

    def _exchange(self, request: bytes, frames: int) -> np.ndarray:
        sock = self._connect()
        try:
            sock.sendall(request)
            status, count = HEADER.unpack(_recv_exact(sock, HEADER.size))
            if status != STATUS_OK:
                raise RuntimeError(f"SNAC server: {_recv_exact(sock, count).decode(errors='replace')}")
            raw = _recv_exact(sock, count * frames * SAMPLES_PER_FRAME * 2)
        except (OSError, RuntimeError):
            self.close()  # half a reply may be in the socket, or the server closed it after an error
            raise
        return np.frombuffer(raw, dtype="<i2").reshape(count, frames * SAMPLES_PER_FRAME)



def codec_server_env(settings: CodecServerSettings) -> dict[str, str]:
    """Environment of the shared SNAC process (`python -m gateway.speech.codec_server`)."""
    return {SERVER_ENV: settings.to_env()}


def serve_from_env() -> CodecServer | None:
    """Start the server SERVER_ENV describes, if set."""
    text = os.environ.get(SERVER_ENV)
    if not text:
        return None
    server = CodecServer.load(CodecServerSettings.from_env(text))
    server.start()
    return server


def main() -> int:
    """`python -m gateway.speech.codec_server`: the shared SNAC process of `serve --workers --snac-placement shared`
    (the supervisor sets SERVER_ENV); serves until SIGTERM or SIGINT."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s snac-server %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server = serve_from_env()
    if server is None:
        log.error("%s is not set: nothing to serve", SERVER_ENV)
        return 2
    stop.wait()
    server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
