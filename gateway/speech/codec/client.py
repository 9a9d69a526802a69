"""The client of the shared codec server, one per gateway process: it stands in for the in-process decoder (it is a
`decoder.Decoder`), keeps one connection and multiplexes its sentences on it by stream id (`wire`). When the
connection breaks, its open streams fail with the reason and the next stream connects anew. Also
`wait_for_server`: a worker takes users only once the server listens.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from gateway.orpheus import Frame
from gateway.speech.codec.wire import (
    ALL_STREAMS,
    CHUNK,
    END,
    ERROR,
    FINISH,
    LAST,
    LEAD,
    LEAD_MS_LIMIT,
    MAX_MESSAGE_BYTES,
    MAX_PUSH_FRAMES,
    MESSAGE,
    OPEN,
    PUSH,
    PUSH_HEAD,
    RELEASE,
    STREAM_HELLO,
)
from gateway.speech.stream_decoder import FIRST_AUDIO_LOOKAHEAD, DecodeStats, DecodeStream, lead_always_runs

log = logging.getLogger(__name__)

SERVER_POLL_S = 0.25  # how often `wait_for_server` tries a server that does not listen yet


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
