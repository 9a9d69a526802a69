"""A cached sentence as stored: its PCM as synthesised (24 kHz mono int16), its word timings and visemes, under
a checksum.

Bytes: `MAGIC`, a BLAKE2b-128 digest of the rest, the header's length (4 bytes, little-endian), the header (JSON:
words, visemes, timing source, sample count) and the PCM (little-endian int16). Raw PCM rather than Opus: a hit is
played from it at once (no decode on the event loop) and it is what a repeat and the word timings need; 48 kB per
second of speech, a few seconds per sentence.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import asdict, dataclass

import numpy as np

from gateway.timing import VisemeTiming, WordTiming

MAGIC = b"OGP1"
DIGEST_BYTES = 16
_LENGTH = struct.Struct("<I")


class CorruptEntryError(ValueError):
    """Stored bytes that are not a whole, unchanged entry: dropped and made again, never played."""


@dataclass(frozen=True, eq=False)
class PhraseEntry:
    """One sentence's audio and timings (offsets into its normalised text; times in ms of its audio at rate 1)."""

    pcm: np.ndarray
    words: list[WordTiming]
    visemes: list[VisemeTiming]
    timing_source: str

    def encode(self) -> bytes:
        header = json.dumps({"samples": len(self.pcm), "source": self.timing_source,
                             "words": [asdict(w) for w in self.words],
                             "visemes": [asdict(v) for v in self.visemes]}, separators=(",", ":")).encode()
        body = _LENGTH.pack(len(header)) + header + self.pcm.astype("<i2", copy=False).tobytes()
        return MAGIC + hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() + body

    @classmethod
    def decode(cls, data: bytes) -> PhraseEntry:
        """The entry in `data`; `CorruptEntryError` if its checksum or shape is wrong."""
        head = len(MAGIC) + DIGEST_BYTES
        if len(data) < head + _LENGTH.size or not data.startswith(MAGIC):
            raise CorruptEntryError("not a phrase entry")
        body = memoryview(data)[head:]
        if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != data[len(MAGIC):head]:
            raise CorruptEntryError("checksum mismatch")
        (length,) = _LENGTH.unpack_from(body)
        try:
            header = json.loads(bytes(body[_LENGTH.size:_LENGTH.size + length]))
            pcm = np.frombuffer(body[_LENGTH.size + length:], dtype="<i2").astype(np.int16)
            if len(pcm) != header["samples"]:
                raise CorruptEntryError("sample count mismatch")
            return cls(pcm, [WordTiming(**w) for w in header["words"]],
                       [VisemeTiming(**v) for v in header["visemes"]], str(header["source"]))
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, CorruptEntryError):
                raise
            raise CorruptEntryError(f"unreadable header: {exc}") from None

    @property
    def nbytes(self) -> int:
        return self.pcm.nbytes
