"""The shared codec server: one exact streaming decoder (`stream_decoder.StreamDecoder`) for every connection, so
the sentences of every gateway worker share its batched steps and one GPU context. An asyncio loop in its own
thread reads each connection (`_StreamConnection`) and writes each stream's audio back; a stream's own trouble fails
that stream only, a connection that breaks the protocol (`wire`) gets an error and is closed. Also the settings the
supervisor hands the SNAC process (`CodecServerSettings` in SERVER_ENV). Why one process:
docs/decisions/shared-snac-process.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from gateway.orpheus import SAMPLE_RATE, SLOTS_PER_FRAME, Frame
from gateway.speech.codec.wire import (
    ALL_STREAMS,
    CHUNK,
    END,
    ERROR,
    FINISH,
    FRAME_BYTES,
    LAST,
    LEAD,
    MAX_CONNECTION_STREAMS,
    MAX_STREAM_FRAMES,
    MAX_UNSENT_BYTES,
    MESSAGE,
    OPEN,
    PUSH_HEAD,
    RELEASE,
    STREAM_HELLO,
    check_framing,
)
from gateway.speech.decoder import DecoderSettings, load_stream_decoder
from gateway.speech.errors import CodecWireError
from gateway.speech.stream_decoder import DecodeStream, StreamDecoder

T = TypeVar("T")

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 10.0
SERVER_ENV = "ORPHEUS_GATEWAY_SNAC_SERVER"  # CodecServerSettings as JSON, set by the supervisor


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


def codec_server_env(settings: CodecServerSettings) -> dict[str, str]:
    """Environment of the shared SNAC process (`python -m gateway.cluster.snac_process`)."""
    return {SERVER_ENV: settings.to_env()}


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
    waits for this stream's first audio) holds until audio is sent, and runs from then on: run down from its
    report, it lengthened a waiting listener's first-audio hold (docs/decisions/codec-client-lead.md)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lead_s = 0.0
        self._at = clock()
        self._runs = True

    def report(self, lead_ms: int, runs: bool) -> None:
        self._lead_s, self._at, self._runs = lead_ms / 1000, self._clock(), runs

    def sent(self, samples: int) -> None:
        if not self._runs:  # the listener plays from this audio on
            self._runs, self._at = True, self._clock()
        self._lead_s += samples / SAMPLE_RATE

    def __call__(self) -> float:
        return self._lead_s - (self._clock() - self._at) if self._runs else self._lead_s


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
                raise CodecWireError(f"not a SNAC stream client: it began with {hello!r}, not {STREAM_HELLO!r}")
            self._writer.write(STREAM_HELLO)
            while True:
                kind, stream_id, size = MESSAGE.unpack(await self._reader.readexactly(MESSAGE.size))
                check_framing(kind, size)
                self._apply(kind, stream_id, await self._reader.readexactly(size))
        except CodecWireError as exc:
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
