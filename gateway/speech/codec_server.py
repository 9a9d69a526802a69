"""SNAC decoding served over a Unix socket: one decoder for every gateway process on a host.

Why: every process that runs CUDA kernels has its own CUDA context, and the GPU time-slices between contexts
instead of running their kernels side by side. With SNAC in each gateway worker and the model in vLLM's
engine-core process, generation slowed 2x at 384 streams on an H200 (docs/benchmarks.md). A codec server is
one context and one batch for all workers (`--snac-placement shared`: `python -m gateway.cluster.snac_process`,
started by the supervisor; measured: fewer underruns than a decoder per worker). Running it inside vLLM's
engine-core process instead (a vLLM plugin, sharing the model's CUDA context) measured slower at every load on an
H200 and was removed: the GPU runs the sum of both workloads wherever SNAC is placed (docs/benchmarks.md).

A server (`StreamCodecServer`) runs ONE exact streaming decoder (`stream_decoder.StreamDecoder`) for all its
connections, so the sentences of every worker share its batched steps. A client (`CodecStreamClient`, one per
gateway process) keeps one connection and multiplexes its sentences on it by a u32 stream id of its choosing.

The protocol. Both ends first send the 8 bytes STREAM_HELLO; a server answers any other start with a connection
error (ERROR on ALL_STREAMS, below) and closes; a client that does not get them back fails its streams. Then
messages, little-endian: u32 kind, u32 stream id, u32 payload bytes (<= MAX_MESSAGE_BYTES), payload:
  client  OPEN 1     -
          PUSH 2     i32 lead_ms, u32 lookahead (0..7), u32 lead_runs (0|1), then n x 7 int16 codes
                     (1 <= n <= MAX_PUSH_FRAMES)
          FINISH 3   i32 lead_ms, u32 lead_runs
          RELEASE 4  -  (the sentence is over, whatever state it is in; the id is free again)
  server  CHUNK 5    u32 last (1: the stream's last audio), then int16 PCM
          END 6      -  (all of the stream's audio is out)
          ERROR 7    UTF-8 text: that stream failed and gets nothing more; stream id ALL_STREAMS: the connection
                     broke the protocol (an unknown kind, a payload of the wrong size) and is closed
`lead_ms` is how far the client's audio out runs ahead of real time; the server carries it on (less the time since,
plus the audio sent since) for the decoder's deadline order. `lead_runs` 0: the listener waits for this stream's
first audio (or its buffer to fill), so the lead holds until the server sends audio, and runs from then on. A
stream's own trouble (bad codes, a push after its finish, no free slot, an unknown or reused id, more than
MAX_STREAM_FRAMES frames) fails that stream only. A closed connection releases its streams; a client whose
connection breaks (the server died or restarted) fails its open streams with the reason, and its next stream
connects anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import struct
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gateway.orpheus import SAMPLE_RATE, SLOTS_PER_FRAME, Frame
from gateway.speech.stream_decoder import (
    FIRST_AUDIO_LOOKAHEAD,
    DecodeStats,
    DecodeStream,
    StreamDecoder,
    lead_always_runs,
)

T = TypeVar("T")

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
SERVER_ENV = "ORPHEUS_GATEWAY_SNAC_SERVER"  # CodecServerSettings as JSON, set by the supervisor

# --- the protocol (module docstring) ---
STREAM_HELLO = b"SNACSTR2"  # 2: PUSH and FINISH carry lead_runs
MESSAGE = struct.Struct("<III")  # kind, stream id, payload bytes
OPEN, PUSH, FINISH, RELEASE, CHUNK, END, ERROR = range(1, 8)
PUSH_HEAD = struct.Struct("<iII")  # lead_ms, lookahead, lead_runs
LEAD = struct.Struct("<iI")  # lead_ms, lead_runs
LAST = struct.Struct("<I")  # a chunk ends its stream
ALL_STREAMS = 0xFFFFFFFF  # the stream id of a connection's own error
FRAME_BYTES = SLOTS_PER_FRAME * 2
MAX_PUSH_FRAMES = 256  # a client splits longer pushes
MAX_MESSAGE_BYTES = 1 << 20  # above a push's and a chunk's largest (a first chunk: 7 frames of PCM, 28 KiB)
MAX_STREAM_FRAMES = 1 << 16  # 93 min of audio: far beyond any sentence (max_tokens bounds them)
MAX_CONNECTION_STREAMS = 4096  # ids a connection holds open at once (its worker's sentences, not yet released)
MAX_UNSENT_BYTES = 64 << 20  # audio waiting for a client that stopped reading: the connection is dropped
SERVER_POLL_S = 0.25  # how often `wait_for_server` tries a server that does not listen yet
LEAD_MS_LIMIT = (1 << 31) - 1


@dataclass(frozen=True)
class DecoderSettings:
    """What a SNAC stream decoder needs, made from the gateway's config by `synthesizer.decoder_settings`: a
    gateway process loads its own decoder from it, the shared SNAC process its one for every worker."""

    snac_model: str
    device: str = "auto"
    snac_dtype: str = "auto"
    cuda_graphs: bool = True
    max_batch: int = 256  # streams per step
    max_streams: int = 512  # stream slots, for the sentences of all workers together
    compile: bool | None = None  # the step through torch.compile (the gateway's snac_compile; None: on a GPU)


@dataclass(frozen=True)
class CodecServerSettings:
    """The shared SNAC process's settings, handed over by the supervisor in SERVER_ENV: where it serves, and its
    decoder."""

    socket: str
    decoder: DecoderSettings

    def to_env(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls, text: str) -> CodecServerSettings:
        fields = json.loads(text)
        return cls(socket=fields["socket"], decoder=DecoderSettings(**fields["decoder"]))


class ProtocolError(RuntimeError):
    """A client sent something that is not a message of the protocol: its connection is closed."""


# --- server -------------------------------------------------------------------------------------------------


class StreamCodecServer:
    """Serves the stream protocol with one `StreamDecoder` (which it owns) for every connection: the decoder's
    worker thread decodes, an asyncio loop in one more thread reads every connection (`_StreamConnection`) and
    writes each stream's audio back."""

    def __init__(self, decoder: StreamDecoder, path: str | Path) -> None:
        self.decoder = decoder
        self.path = Path(path)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.AbstractServer | None = None
        self._connections: dict[_StreamConnection, asyncio.Task[Any]] = {}

    @classmethod
    def load(cls, settings: CodecServerSettings) -> StreamCodecServer:
        return cls(load_stream_decoder(settings.decoder), settings.socket)

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.unlink(missing_ok=True)  # a server of an earlier process
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="snac-server-streams", daemon=True)
        self._thread.start()
        self._loop = loop
        try:
            self._server = asyncio.run_coroutine_threadsafe(
                asyncio.start_unix_server(self._serve, str(self.path)), loop).result(CLOSE_TIMEOUT_S)
        except BaseException:
            self.close()
            raise
        log.info("SNAC streams served on %s", self.path)

    def run_in_loop(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` in the streams' event loop (its thread) and wait for it: what the SNAC process adds to
        that loop (the lag monitor, `gateway.cluster.snac_process`)."""
        if self._loop is None:
            coroutine.close()
            raise RuntimeError("the codec server is not started")
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(CLOSE_TIMEOUT_S)

    def close(self) -> None:
        """Drop every connection (their clients fail their open streams), then stop the decoder and the loop."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(Exception):  # closing regardless: a hung connection must not keep the socket
                asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(CLOSE_TIMEOUT_S)
        self.decoder.close()
        if loop is not None and self._thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
            if not self._thread.is_alive():
                loop.close()
            self._loop = None
        self.path.unlink(missing_ok=True)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for connection in self._connections:
            connection.abort()
        if self._connections:
            await asyncio.wait(list(self._connections.values()), timeout=CLOSE_TIMEOUT_S)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connection = _StreamConnection(self.decoder, reader, writer)
        task = asyncio.current_task()
        assert task is not None
        self._connections[connection] = task
        try:
            await connection.run()
        finally:
            del self._connections[connection]


class _ClientLead:
    """A remote stream's deadline for the decoder's order (`DecodeStream.lead_s`): the lead its client last
    reported, less the time since, plus the audio sent to it since. A lead reported as not running (the listener
    waits for this stream's first audio) holds until audio is sent, and runs from then on. Run down from its
    report, it lengthened the first audio's hold for a listener that was not playing. Measured over WebRTC on one
    H100 (2026-12-06 midday, A/B): the hold after the first frame 196 -> 170 ms at 128 peers, 277 -> 222 at 256
    (in process: 82 and 212), server first audio 66 ms sooner at 256."""

    def __init__(self) -> None:
        self._lead_s = 0.0
        self._at = time.monotonic()
        self._runs = True

    def report(self, lead_ms: int, runs: bool) -> None:
        self._lead_s, self._at, self._runs = lead_ms / 1000, time.monotonic(), runs

    def sent(self, samples: int) -> None:
        if not self._runs:  # the listener plays from this audio on
            self._runs, self._at = True, time.monotonic()
        self._lead_s += samples / SAMPLE_RATE

    def __call__(self) -> float:
        return self._lead_s - (time.monotonic() - self._at) if self._runs else self._lead_s


@dataclass(eq=False)
class _RemoteStream:
    """A stream of a connection: its decoder stream, its deadline, the task that writes its audio back."""

    stream: DecodeStream
    lead: _ClientLead
    writer: asyncio.Task[None] | None = None
    frames: int = 0


class _StreamConnection:
    """One client connection of a `StreamCodecServer`: its messages go to the decoder, its streams' audio back."""

    def __init__(self, decoder: StreamDecoder, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.decoder = decoder
        self._reader = reader
        self._writer = writer
        self._streams: dict[int, _RemoteStream] = {}

    def abort(self) -> None:
        self._writer.transport.abort()

    async def run(self) -> None:
        try:
            if (hello := await self._reader.readexactly(len(STREAM_HELLO))) != STREAM_HELLO:
                raise ProtocolError(f"not a SNAC stream client: it began with {hello!r}, not {STREAM_HELLO!r}")
            self._writer.write(STREAM_HELLO)
            while True:
                kind, stream_id, size = MESSAGE.unpack(await self._reader.readexactly(MESSAGE.size))
                _check_framing(kind, size)
                self._apply(kind, stream_id, await self._reader.readexactly(size))
        except ProtocolError as exc:
            self._send(ERROR, ALL_STREAMS, str(exc).encode())
        except (asyncio.IncompleteReadError, OSError):  # the client went away (ConnectionError included)
            pass
        finally:
            for stream_id in list(self._streams):
                self._release(stream_id)
            self._writer.close()  # after what was written (an error) has gone out

    def _apply(self, kind: int, stream_id: int, payload: bytes) -> None:
        if kind == OPEN:
            self._open(stream_id)
        elif kind == RELEASE:
            self._release(stream_id)
        elif (remote := self._streams.get(stream_id)) is None:
            self._send(ERROR, stream_id, f"stream {stream_id} is not open".encode())
        elif kind == FINISH:
            lead_ms, runs = LEAD.unpack(payload)
            remote.lead.report(lead_ms, bool(runs))
            self.decoder.finish(remote.stream)
        else:
            self._push(stream_id, remote, payload)

    def _open(self, stream_id: int) -> None:
        if stream_id in self._streams:
            self._fail(stream_id, f"stream {stream_id} is open already")
            return
        if len(self._streams) >= MAX_CONNECTION_STREAMS:
            self._send(ERROR, stream_id, f"more than {MAX_CONNECTION_STREAMS} streams open on one connection".encode())
            return
        lead = _ClientLead()
        remote = _RemoteStream(self.decoder.open(lead), lead)
        remote.writer = asyncio.create_task(self._write_audio(stream_id, remote))
        self._streams[stream_id] = remote

    def _push(self, stream_id: int, remote: _RemoteStream, payload: bytes) -> None:
        lead_ms, lookahead, runs = PUSH_HEAD.unpack_from(payload)
        count = (len(payload) - PUSH_HEAD.size) // FRAME_BYTES
        if remote.frames + count > MAX_STREAM_FRAMES:
            self._fail(stream_id, f"a stream has at most {MAX_STREAM_FRAMES} frames")
            return
        codes = np.frombuffer(payload, dtype="<i2", offset=PUSH_HEAD.size).reshape(count, SLOTS_PER_FRAME)
        frames: list[Frame] = [tuple(row) for row in codes.tolist()]  # type: ignore[misc]
        remote.frames += count
        remote.lead.report(lead_ms, bool(runs))
        remote.stream.lookahead = lookahead  # read once its head is ready, as in-process
        # The decoder checks the codes and `bridge` the lookahead: a bad one fails this stream.
        self.decoder.push(remote.stream, frames)

    def _release(self, stream_id: int) -> None:
        remote = self._streams.pop(stream_id, None)
        if remote is not None:
            self.decoder.release(remote.stream)
            if remote.writer is not None:
                remote.writer.cancel()

    def _fail(self, stream_id: int, message: str) -> None:
        self._release(stream_id)
        self._send(ERROR, stream_id, message.encode())

    async def _write_audio(self, stream_id: int, remote: _RemoteStream) -> None:
        while (item := await remote.stream.chunks.get()) is not None:
            if isinstance(item, BaseException):
                # The decoder's "audio decoding failed: " is the client's to add.
                self._send(ERROR, stream_id, str(item).removeprefix("audio decoding failed: ").encode())
                return
            pcm, last = item
            self._send(CHUNK, stream_id, LAST.pack(last) + pcm.astype("<i2").tobytes())
            remote.lead.sent(len(pcm))
        self._send(END, stream_id)

    def _send(self, kind: int, stream_id: int, payload: bytes = b"") -> None:
        if self._writer.is_closing():
            return
        if self._writer.transport.get_write_buffer_size() > MAX_UNSENT_BYTES:
            log.warning("a SNAC stream client stopped reading; dropping its connection")
            self.abort()
            return
        self._writer.write(MESSAGE.pack(kind, stream_id, len(payload)) + payload)


def _check_framing(kind: int, size: int) -> None:
    """A client message's kind and payload size agree with the protocol (else the connection is closed)."""
    if kind in (OPEN, RELEASE):
        good = size == 0
    elif kind == FINISH:
        good = size == LEAD.size
    elif kind == PUSH:
        frames, rest = divmod(size - PUSH_HEAD.size, FRAME_BYTES)
        good = rest == 0 and 1 <= frames <= MAX_PUSH_FRAMES
    else:
        raise ProtocolError(f"unknown message kind {kind}")
    if not good:
        raise ProtocolError(f"message kind {kind} with {size} payload bytes (push: {PUSH_HEAD.size} + "
                            f"{FRAME_BYTES} per frame, 1..{MAX_PUSH_FRAMES} frames)")


# --- client -------------------------------------------------------------------------------------------------


class CodecStreamClient:
    """Stands in for `StreamDecoder` in the synthesizer (`open`, `push`, `finish`, `release`, each stream's audio in
    its `DecodeStream.chunks`); the streams decode in a `StreamCodecServer`. Lives on one event loop and never
    blocks it. One connection at a time (`_StreamLink`), opened by the first stream; when it breaks, its open
    streams fail with the reason and the next stream connects anew."""

    def __init__(self, path: str | Path, connect_timeout_s: float = 10.0) -> None:
        self.path = str(path)
        self.connect_timeout_s = connect_timeout_s
        # StreamDecoder's metrics hook and counters, for the synthesizer's callers: idle here, because the batches
        # run in the SNAC process, which reports them itself (gateway.cluster.snac_process).
        self.on_batch: Callable[[int, float, int, int], None] | None = None
        self.on_first_audio: Callable[[bool, float, float | None], None] | None = None
        self.stats = DecodeStats()
        self._link: _StreamLink | None = None
        self._ids = itertools.count()
        self._where: dict[DecodeStream, tuple[_StreamLink, int]] = {}
        self._closed = False

    def open(self, lead_s: Callable[[], float], lookahead: int = FIRST_AUDIO_LOOKAHEAD, *,
             lead_runs: Callable[[], bool] = lead_always_runs) -> DecodeStream:
        if self._closed:
            raise RuntimeError("decoder is closed")
        loop = asyncio.get_running_loop()
        link = self._link
        if link is None or link.broken or link.loop is not loop:
            link = self._link = _StreamLink(self.path, loop, self.connect_timeout_s)
        stream = DecodeStream(loop, lead_s, lookahead, lead_runs)
        stream_id = next(self._ids) % ALL_STREAMS
        link.open(stream_id, stream)
        self._where[stream] = (link, stream_id)
        return stream

    def push(self, stream: DecodeStream, frames: Sequence[Frame]) -> None:
        if (where := self._where.get(stream)) is None or not frames:
            return
        link, stream_id = where
        codes = np.asarray(frames, dtype="<i2")
        for at in range(0, len(codes), MAX_PUSH_FRAMES):
            link.send(PUSH, stream_id, PUSH_HEAD.pack(_lead_ms(stream), stream.lookahead, stream.lead_runs())
                      + codes[at:at + MAX_PUSH_FRAMES].tobytes())

    def finish(self, stream: DecodeStream) -> None:
        if (where := self._where.get(stream)) is not None:
            where[0].send(FINISH, where[1], LEAD.pack(_lead_ms(stream), stream.lead_runs()))

    def release(self, stream: DecodeStream) -> None:
        """The sentence is over (done, failed or cancelled): the server frees its slot."""
        if (where := self._where.pop(stream, None)) is not None:
            where[0].release(where[1])

    def close(self) -> None:
        """From any thread (the synthesizer closes its decoder from a worker thread)."""
        self._closed = True
        if (link := self._link) is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed already: so is the connection
                link.loop.call_soon_threadsafe(link.close)


def _lead_ms(stream: DecodeStream) -> int:
    return max(-LEAD_MS_LIMIT, min(LEAD_MS_LIMIT, round(stream.lead_s() * 1000)))


class _StreamLink:
    """One connection of a `CodecStreamClient`: sends its messages in order (queued until it is up) and puts each
    stream's audio into its `DecodeStream.chunks`; once broken, every stream still waiting for audio gets why."""

    def __init__(self, path: str, loop: asyncio.AbstractEventLoop, connect_timeout_s: float) -> None:
        self.path = path
        self.loop = loop
        self.broken = False
        self._streams: dict[int, DecodeStream] = {}  # opened and not ended, failed or released
        self._queued: list[bytes] = []  # sent before the connection was up
        self._writer: asyncio.StreamWriter | None = None
        self._task = loop.create_task(self._run(connect_timeout_s))

    def open(self, stream_id: int, stream: DecodeStream) -> None:
        self._streams[stream_id] = stream
        self.send(OPEN, stream_id)

    def release(self, stream_id: int) -> None:
        self._streams.pop(stream_id, None)
        self.send(RELEASE, stream_id)

    def send(self, kind: int, stream_id: int, payload: bytes = b"") -> None:
        if self.broken:
            return
        message = MESSAGE.pack(kind, stream_id, len(payload)) + payload
        if self._writer is None:
            self._queued.append(message)
        else:
            self._writer.write(message)

    def close(self) -> None:
        self._task.cancel()

    async def _run(self, connect_timeout_s: float) -> None:
        writer: asyncio.StreamWriter | None = None
        reason = "the SNAC stream client was closed"
        try:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self.path), connect_timeout_s)
                writer.write(STREAM_HELLO)
                answer = await asyncio.wait_for(reader.readexactly(len(STREAM_HELLO)), connect_timeout_s)
            except (OSError, asyncio.IncompleteReadError, TimeoutError) as exc:
                raise ConnectionError(f"SNAC server at {self.path} unreachable: {exc!r}") from exc
            if answer != STREAM_HELLO:
                raise ConnectionError(f"SNAC server at {self.path} does not serve SNAC streams: it answered "
                                      f"{answer!r}")
            writer.write(b"".join(self._queued))
            self._queued.clear()
            self._writer = writer
            await self._read(reader)
        except ConnectionError as exc:
            reason = str(exc)
        finally:
            self.broken = True
            if writer is not None:
                writer.close()
            error = RuntimeError(f"audio decoding failed: {reason}")
            for stream in self._streams.values():
                stream.chunks.put_nowait(error)
            self._streams.clear()

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while True:
            kind, stream_id, size = MESSAGE.unpack(await self._receive(reader, MESSAGE.size))
            if kind not in (CHUNK, END, ERROR) or size > MAX_MESSAGE_BYTES:
                raise ConnectionError(f"SNAC server at {self.path} sent a message of kind {kind}, {size} bytes")
            payload = await self._receive(reader, size)
            if kind == ERROR and stream_id == ALL_STREAMS:
                raise ConnectionError(f"SNAC server at {self.path}: {payload.decode(errors='replace')}")
            stream = self._streams.get(stream_id)
            if stream is None:  # released meanwhile
                continue
            if kind == CHUNK:
                pcm = np.frombuffer(payload, dtype="<i2", offset=LAST.size).astype(np.int16)
                stream.chunks.put_nowait((pcm, bool(LAST.unpack_from(payload)[0])))
                continue
            del self._streams[stream_id]
            stream.chunks.put_nowait(None if kind == END else RuntimeError(
                f"audio decoding failed: SNAC server: {payload.decode(errors='replace')}"))

    async def _receive(self, reader: asyncio.StreamReader, size: int) -> bytes:
        try:
            return await reader.readexactly(size)
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise ConnectionError(f"SNAC server at {self.path} closed the connection") from exc


def load_stream_decoder(settings: DecoderSettings) -> StreamDecoder:
    """The exact streaming decoder as the settings say: served, or in a gateway process."""
    from gateway.speech.snac import StreamingSnac  # torch: only in the process that decodes

    snac = StreamingSnac.load(settings.snac_model, settings.device, settings.snac_dtype,
                              max_streams=settings.max_streams, capture_graphs=settings.cuda_graphs,
                              max_batch=settings.max_batch, compile=settings.compile)
    return StreamDecoder(snac, settings.max_batch)


async def wait_for_server(path: str | Path, poll_s: float = SERVER_POLL_S) -> None:
    """Return once a codec server accepts connections at `path`. The SNAC process listens only after loading SNAC
    and capturing (and, with `snac_compile`, compiling) its steps, which can outlast `vllm serve`'s start: until
    then a worker must not take users whose sentences it could not decode."""
    waiting = False
    while True:
        try:
            _, writer = await asyncio.open_unix_connection(str(path))
        except OSError:
            if not waiting:
                log.info("waiting for the SNAC server at %s", path)
                waiting = True
            await asyncio.sleep(poll_s)
            continue
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        if waiting:
            log.info("the SNAC server at %s is up", path)
        return


def codec_server_env(settings: CodecServerSettings) -> dict[str, str]:
    """Environment of the shared SNAC process (`python -m gateway.cluster.snac_process`)."""
    return {SERVER_ENV: settings.to_env()}
