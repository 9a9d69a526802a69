"""The session protocol as types: the offer body of the signalling route, and every message on the `control`
data channel, client -> server and server -> client.

This module is the single source of the protocol: the server parses and builds messages with these classes,
the headless client (`gateway.devtools.client`) does too, `protocol_schema()` generates the JSON Schema that
`docs/protocol.md` shows and the page loads (`gateway/web/protocol.schema.json`, checked equal to the generated one by
the tests), and the browser test validates what the page sends and receives against it.

Wire rules: one JSON object per message, UTF-8 text, at most `MAX_MESSAGE_BYTES`; `type` names the message.
Unknown fields are ignored (a newer client may send more). Bad input never costs the session: `parse_client_message`
turns it into a `ProtocolError` whose code and message become an `error` event.

Imports msgspec and the standard library, its error (`gateway.rtc.errors`) and the bounds it states: the
configuration's (jitter buffer) and the lesson rate's (`gateway.media.stretch`); nothing else of the gateway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from gateway.config import JITTER_BUFFER_MAX_MS
from gateway.media.stretch import LESSON_RATE_RANGE
from gateway.rtc.errors import ProtocolError

CONTROL_LABEL = "control"  # the data channel the protocol runs on
MAX_MESSAGE_BYTES = 16 * 1024
MAX_ID_CHARS = 128
SCHEMA_ID = "https://orpheus-gateway.dev/protocol.schema.json"

UtteranceId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS,
                                          description="Names an utterance within its session.")]
VoiceName = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS, description="A served voice, or `model/voice`.")]
LanguageTag = Annotated[str, msgspec.Meta(
    min_length=2, max_length=35, pattern=r"^[A-Za-z]{2,8}(-[A-Za-z0-9]{1,8})*$",
    description="BCP-47 language (en-US, pt-BR): spoken by a model serving it, with that model's default voice "
                "unless `voice` names one of its voices.")]
JitterBufferMs = Annotated[int, msgspec.Meta(ge=0, le=JITTER_BUFFER_MAX_MS,
                                             description="Audio queued before an utterance starts playing.")]
PingToken = int | float | str | None
# The bounds are the schema's (the page reads them); the session checks them with `stretch.check_rate` so an
# out-of-range rate gets its own `invalid_rate` error naming the bounds.
PlaybackRate = Annotated[float, msgspec.Meta(
    description=f"Playback speed, pitch kept: 1 as spoken, {LESSON_RATE_RANGE[0]} twice as slow.",
    extra_json_schema={"minimum": LESSON_RATE_RANGE[0], "maximum": LESSON_RATE_RANGE[1]})]
WordIndex = Annotated[int, msgspec.Meta(ge=0, description="A word of an utterance, counted from 0 across its "
                                        "sentences (the `first_word` of its `words` event + its place there).")]
MAX_PLAYED_MS = 24 * 3600 * 1000


# --- signalling ------------------------------------------------------------------------------------------

class Offer(msgspec.Struct, kw_only=True):
    """`POST /v1/webrtc/offer` body: a browser's complete offer (ICE gathered), receiving audio and opening the
    `control` data channel."""

    sdp: Annotated[str, msgspec.Meta(min_length=1)]
    type: Literal["offer"]
    voice: VoiceName | None = None
    language: LanguageTag | None = None  # the session's default voice: this language's (`voice` wins)
    jitter_buffer_ms: JitterBufferMs | None = None


class Answer(msgspec.Struct, kw_only=True):
    """The offer route's answer."""

    sdp: str
    type: Literal["answer"]
    session_id: str


# --- client -> server ------------------------------------------------------------------------------------

class Speak(msgspec.Struct, tag_field="type", tag="speak", kw_only=True, omit_defaults=True):
    """Say `text` as utterance `id`. With `more`, further pieces of the same id follow (an LLM writing the
    lesson); each sentence starts as soon as it is complete; the last piece has `more` false or absent."""

    id: UtteranceId
    text: str
    voice: VoiceName | None = None
    language: LanguageTag | None = None
    interrupt: bool = False  # cancel what is playing and queued first (barge-in)
    more: bool = False
    rate: PlaybackRate = 1.0  # set by the first piece; later pieces' rate is ignored
    # The phrase cache (`--phrase-cache`): true a scripted line (kept and shared), false a private one (never
    # kept); absent: the deployment's choice. Set by the first piece.
    cache: bool | None = None


class Cancel(msgspec.Struct, tag_field="type", tag="cancel", kw_only=True, omit_defaults=True):
    """Stop utterance `id`, or (without `id`) the current one and everything queued."""

    id: UtteranceId | None = None


class Ping(msgspec.Struct, tag_field="type", tag="ping", kw_only=True, omit_defaults=True):
    """Heartbeat: once sent, the client must keep pinging (the server closes a silent session). `t` comes back
    in `pong`."""

    t: PingToken = None


class Repeat(msgspec.Struct, tag_field="type", tag="repeat", kw_only=True, omit_defaults=True):
    """Play utterance `id` of this session again (words `from_word`..`to_word` inclusive, or all of it) from the
    session's replay cache, at `rate`, without asking the engine. It is a new utterance: `new_id`, or
    `"<id>#r<n>"` (n counts the repeats of `id` in this session); its `queued` names `repeat_of`."""

    id: UtteranceId
    new_id: UtteranceId | None = None
    from_word: WordIndex | None = None
    to_word: WordIndex | None = None
    rate: PlaybackRate = 1.0
    interrupt: bool = False


class Played(msgspec.Struct, tag_field="type", tag="played", kw_only=True, omit_defaults=True):
    """The page's own playout: how much of utterance `id` it has played (a metric; nothing is answered)."""

    id: UtteranceId
    played_ms: Annotated[float, msgspec.Meta(ge=0, le=MAX_PLAYED_MS)]


MAX_PREFETCH_TEXTS = 64


class Prefetch(msgspec.Struct, tag_field="type", tag="prefetch", kw_only=True, omit_defaults=True):
    """Lines about to be spoken (a lesson's next lines): the gateway makes those not in the phrase cache while the
    engine has room, and answers `prefetched`. `voice` and `language` route as `speak`'s do: a later `speak` with
    the same ones finds the lines made."""

    texts: Annotated[list[str], msgspec.Meta(min_length=1, max_length=MAX_PREFETCH_TEXTS)]
    voice: VoiceName | None = None
    language: LanguageTag | None = None


ClientMessage = Speak | Cancel | Ping | Repeat | Played | Prefetch
CLIENT_TYPES = ("speak", "cancel", "ping", "repeat", "played", "prefetch")


# --- server -> client ------------------------------------------------------------------------------------

class Event(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of server events."""


class Ready(Event, tag="ready"):
    session_id: str
    voices: list[str]
    voice: str
    sample_rate: int
    jitter_buffer_ms: int


class Queued(Event, tag="queued", omit_defaults=True):
    id: str
    position: int  # utterances ahead of this one (0: next)
    repeat_of: str | None = None  # a `repeat`: the utterance it replays


class Started(Event, tag="started"):
    """The utterance's first audio left the server. Where the time went, in ms since the `speak`: first token from
    the engine (`ttft_ms`), first decode window to SNAC (`ttfw_ms`), first audio out (`ttfa_ms`). An utterance that
    follows another request's generation of the same line (the phrase cache's single flight) gets the times its
    first token and window reached it: its first audio's where they came before its `speak` or from another
    process. Both are null when its first sentence was a phrase-cache hit (no engine request) and for a `repeat`."""

    id: str
    ttfa_ms: float | None
    ttft_ms: float | None = None
    ttfw_ms: float | None = None
    rtp_timestamp: int | None = None  # 48 kHz RTP timestamp of its first sample (see `Words.rtp_timestamp`)


class Segment(Event, tag="segment"):
    """Sentence `index` of the utterance starts playing."""

    id: str
    index: int
    text: str


class Done(Event, tag="done"):
    """The utterance's last audio left the server. `played_ms`, `heard_text`, `last_word`: as in `Cancelled`
    (all of it, unless the engine stopped a sentence short)."""

    id: str
    audio_ms: float
    underruns: int
    underrun_ms: float
    underrun_at_ms: list[float] = []  # audio played when each gap inside the audio began (the first 16)
    late_frames: int = 0  # audio frames the server handed to its sender over 10 ms after their 20 ms slot
    max_late_ms: float = 0.0  # the latest of them (what the server adds to delivery jitter)
    played_ms: float = 0.0
    heard_text: str = ""
    last_word: int = -1


class Cancelled(Event, tag="cancelled"):
    """The utterance was cancelled. What the student heard of it: `played_ms` of its audio left the server
    (silence of underruns not counted); `heard_text` is its text up to the end of the last whole word played
    (a prefix of the text at a word boundary; for a `repeat` of a word range, from the range's first word);
    `last_word` is that word's index, -1 if none."""

    id: str
    played_ms: float = 0.0
    heard_text: str = ""
    last_word: int = -1


class Word(msgspec.Struct, kw_only=True):
    """One word: `text == utterance_text[char_start:char_end]` (the text as the client sent it, all its `more`
    pieces together); heard from `start_ms` for `duration_ms` on the utterance's audio timeline."""

    text: str
    char_start: int
    char_end: int
    start_ms: int
    duration_ms: int


class Words(Event, tag="words"):
    """Word timings of sentence `index`, sent once its audio is made and it has started playing (after its
    `segment`, before the next `segment` and before `done`). `start_ms`: where the sentence starts on the
    utterance's audio timeline (the times of `words` are on that timeline too; played at `rate`).
    `rtp_timestamp`: the 48 kHz RTP timestamp of the sentence's first sample in the audio track, so a page maps
    the words onto its own playout (`RTCRtpReceiver.getSynchronizationSources()`); null if unknown.
    `first_word`: the index of its first word in the utterance. `source`: "aligned" (CTC forced alignment) or
    "estimated" (from the audio's energy and syllable counts)."""

    id: str
    index: int
    start_ms: int
    rtp_timestamp: int | None
    source: Literal["aligned", "estimated"]
    first_word: int
    words: list[Word]


class Viseme(msgspec.Struct, kw_only=True):
    """One mouth shape (Oculus-15: sil PP FF TH DD kk CH SS nn RR aa E I O U) on the utterance's timeline, inside
    word `word` (an utterance word index)."""

    viseme: str
    start_ms: int
    duration_ms: int
    word: int


class Visemes(Event, tag="visemes"):
    """Visemes of sentence `index`, sent with its `words` (same `start_ms` and `rtp_timestamp`)."""

    id: str
    index: int
    start_ms: int
    rtp_timestamp: int | None
    visemes: list[Viseme]


class Pong(Event, tag="pong"):
    t: PingToken = None


class Error(Event, tag="error", omit_defaults=True):
    """Something was refused or failed. With `id`, that utterance has ended (its terminal event); without, the
    message or the session is meant (a session the server closes gets one first)."""

    code: str
    message: str
    id: str | None = None
    retry_after_s: float | None = None


class Prefetched(Event, tag="prefetched"):
    """The answer to `prefetch`, in its order: `ready` the texts the phrase cache holds now (a `speak` of them
    starts without an engine request), `pending` those being made while the engine has room (prefetch again to
    ask), `skipped` those not kept (the phrase cache is off)."""

    ready: list[str]
    pending: list[str]
    skipped: list[str]


ServerEvent = Ready | Queued | Started | Segment | Words | Visemes | Done | Cancelled | Pong | Error | Prefetched
TERMINAL_EVENTS = ("done", "cancelled", "error")  # exactly one of these ends every accepted speak

_client_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerEvent)
_encoder = msgspec.json.Encoder()


class _Envelope(msgspec.Struct):
    """Just enough of a message to answer it: its type and id, when they are well formed."""

    type: Any = None
    id: Any = None


def _envelope(raw: str) -> _Envelope | None:
    """None when the message nests too deeply to be read at all."""
    try:
        return msgspec.json.decode(raw, type=_Envelope)
    except msgspec.MsgspecError:
        return _Envelope()
    except RecursionError:
        return None


def speak_id(raw: str | bytes) -> str | None:
    """The id of a speak message, if `raw` is one (to answer a speak that is dropped unread, e.g. rate limited)."""
    if not isinstance(raw, str) or len(raw) > MAX_MESSAGE_BYTES:
        return None
    envelope = _envelope(raw)
    if envelope is None or envelope.type != "speak" or not isinstance(envelope.id, str):
        return None
    utterance_id = envelope.id
    return utterance_id if 0 < len(utterance_id) <= MAX_ID_CHARS else None


def parse_client_message(raw: str | bytes) -> ClientMessage:
    """The typed message of one data-channel message, or `ProtocolError` naming what is wrong."""
    if isinstance(raw, bytes):
        raise ProtocolError("invalid_message", "messages must be JSON text, not binary")
    if len(raw.encode("utf-8", "surrogatepass")) > MAX_MESSAGE_BYTES:
        raise ProtocolError("message_too_large", f"messages are limited to {MAX_MESSAGE_BYTES} bytes")
    try:
        return _client_decoder.decode(raw)
    except msgspec.ValidationError as exc:  # a DecodeError too: caught first
        raise _invalid(raw, str(exc)) from None
    except msgspec.DecodeError:
        raise ProtocolError("invalid_json", "message is not valid JSON") from None
    except RecursionError:
        raise ProtocolError("invalid_message", "message nests too deeply", speak_id(raw)) from None


def _invalid(raw: str, text: str) -> ProtocolError:
    """The error for well-formed JSON that is not a valid message, naming the utterance when it can."""
    if text.startswith("Expected `object`"):
        return ProtocolError("invalid_message", "message must be a JSON object")
    envelope = _envelope(raw)
    if envelope is None:
        return ProtocolError("invalid_message", "message nests too deeply")
    if envelope.type not in CLIENT_TYPES:
        return ProtocolError("unknown_type", f"unknown message type {envelope.type!r}; expected "
                             f"{', '.join(CLIENT_TYPES)}")
    return ProtocolError("invalid_message", f"{envelope.type}: {text}", speak_id(raw))


def parse_server_event(raw: str | bytes) -> ServerEvent:
    """A server event (the headless client's side); `msgspec.ValidationError` if it is not one."""
    return _server_decoder.decode(raw)


def encode(message: Event | Speak | Cancel | Ping | Repeat | Played | Prefetch | Offer | Answer) -> str:
    """One message as JSON text (UTF-8 characters as they are, not escaped)."""
    return _encoder.encode(message).decode()


def to_dict(message: msgspec.Struct) -> dict[str, Any]:
    """A message as the plain JSON object it is on the wire."""
    return json.loads(encode(message))  # type: ignore[arg-type]


# --- JSON Schema -----------------------------------------------------------------------------------------

def protocol_schema() -> dict[str, Any]:
    """JSON Schema (2020-12) of the protocol: `$defs` of every message; `client_message`, `server_event`,
    `offer` and `answer` name the four entry points."""
    (client, server, offer, answer), components = msgspec.json.schema_components(
        [ClientMessage, ServerEvent, Offer, Answer], ref_template="#/$defs/{name}")
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": SCHEMA_ID,
        "title": "orpheus-gateway session protocol",
        "description": f"Data channel '{CONTROL_LABEL}': one JSON object per message, at most "
                       f"{MAX_MESSAGE_BYTES} bytes. Generated from gateway/rtc/protocol.py.",
        "$defs": {**components, "client_message": client, "server_event": server, "offer": offer,
                  "answer": answer},
    }


SCHEMA_FILES = (Path("gateway/web/protocol.schema.json"), Path("docs/protocol.schema.json"))


def schema_text() -> str:
    return json.dumps(protocol_schema(), indent=2, ensure_ascii=False, sort_keys=True) + "\n"


def main() -> int:
    """`python -m gateway.rtc.protocol`: write the schema files (run from the repository root)."""
    text = schema_text()
    for path in SCHEMA_FILES:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
