"""The session protocol as types: the offer body of the signalling route, and every message on the `control`
data channel, client -> server and server -> client.

This module is the single source of the protocol: the server parses and builds messages with these classes,
the headless client (`gateway.devtools.client`) does too, `protocol_schema()` generates the JSON Schema that
`docs/protocol.md` shows and the page loads (`web/protocol.schema.json`, checked equal to the generated one by
the tests), and the browser test validates what the page sends and receives against it.

Wire rules: one JSON object per message, UTF-8 text, at most `MAX_MESSAGE_BYTES`; `type` names the message.
Unknown fields are ignored (a newer client may send more). Bad input never costs the session: `parse_client_message`
turns it into a `ProtocolError` whose code and message become an `error` event.

Imports msgspec and the standard library, and the configuration's bounds; nothing else of the gateway.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from gateway.config import JITTER_BUFFER_MAX_MS

CONTROL_LABEL = "control"  # the data channel the protocol runs on
MAX_MESSAGE_BYTES = 16 * 1024
MAX_ID_CHARS = 128
SCHEMA_ID = "https://orpheus-gateway.dev/protocol.schema.json"

UtteranceId = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_CHARS,
                                          description="Names an utterance within its session.")]
VoiceName = Annotated[str, msgspec.Meta(max_length=MAX_ID_CHARS)]
JitterBufferMs = Annotated[int, msgspec.Meta(ge=0, le=JITTER_BUFFER_MAX_MS,
                                             description="Audio queued before an utterance starts playing.")]
PingToken = int | float | str | None


class ProtocolError(Exception):
    """A message the server refuses: becomes `{"type": "error", "code", "message", "id"?}`."""

    def __init__(self, code: str, message: str, utterance_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.utterance_id = utterance_id


# --- signalling ------------------------------------------------------------------------------------------

class Offer(msgspec.Struct, kw_only=True):
    """`POST /v1/webrtc/offer` body: a browser's complete offer (ICE gathered), receiving audio and opening the
    `control` data channel."""

    sdp: Annotated[str, msgspec.Meta(min_length=1)]
    type: Literal["offer"]
    voice: VoiceName | None = None
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
    interrupt: bool = False  # cancel what is playing and queued first (barge-in)
    more: bool = False


class Cancel(msgspec.Struct, tag_field="type", tag="cancel", kw_only=True, omit_defaults=True):
    """Stop utterance `id`, or (without `id`) the current one and everything queued."""

    id: UtteranceId | None = None


class Ping(msgspec.Struct, tag_field="type", tag="ping", kw_only=True, omit_defaults=True):
    """Heartbeat: once sent, the client must keep pinging (the server closes a silent session). `t` comes back
    in `pong`."""

    t: PingToken = None


ClientMessage = Speak | Cancel | Ping
CLIENT_TYPES = ("speak", "cancel", "ping")


# --- server -> client ------------------------------------------------------------------------------------

class Event(msgspec.Struct, tag_field="type", kw_only=True):
    """Base of server events."""


class Ready(Event, tag="ready"):
    session_id: str
    voices: list[str]
    voice: str
    sample_rate: int
    jitter_buffer_ms: int


class Queued(Event, tag="queued"):
    id: str
    position: int  # utterances ahead of this one (0: next)


class Started(Event, tag="started"):
    """The utterance's first audio left the server. Where the time went, in ms since the `speak`: first token from
    the engine (`ttft_ms`), first decode window to SNAC (`ttfw_ms`), first audio out (`ttfa_ms`)."""

    id: str
    ttfa_ms: float | None
    ttft_ms: float | None = None
    ttfw_ms: float | None = None


class Segment(Event, tag="segment"):
    """Sentence `index` of the utterance starts playing."""

    id: str
    index: int
    text: str


class Done(Event, tag="done"):
    id: str
    audio_ms: float
    underruns: int
    underrun_ms: float


class Cancelled(Event, tag="cancelled"):
    id: str


class Pong(Event, tag="pong"):
    t: PingToken = None


class Error(Event, tag="error", omit_defaults=True):
    """Something was refused or failed. With `id`, that utterance has ended (its terminal event); without, the
    message or the session is meant (a session the server closes gets one first)."""

    code: str
    message: str
    id: str | None = None
    retry_after_s: float | None = None


ServerEvent = Ready | Queued | Started | Segment | Done | Cancelled | Pong | Error
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


def encode(message: Event | Speak | Cancel | Ping | Offer | Answer) -> str:
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


SCHEMA_FILES = (Path("web/protocol.schema.json"), Path("docs/protocol.schema.json"))


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
