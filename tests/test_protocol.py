"""The session protocol module: one parser for every client message (bad input -> a named error), events encoded
as the schema says, and the schema files generated from the types (the page loads gateway/web/protocol.schema.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.rtc import protocol
from gateway.rtc.errors import ProtocolError
from gateway.rtc.protocol import MAX_MESSAGE_BYTES, parse_client_message
from tests.support import assert_valid

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("path", protocol.SCHEMA_FILES)
def test_schema_files_are_generated_from_the_types(path: Path) -> None:
    assert (ROOT / path).read_text(encoding="utf-8") == protocol.schema_text(), \
        f"{path} is stale: run `python -m gateway.rtc.protocol` from the repository root"


def test_docs_show_every_message() -> None:
    doc = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    schema = protocol.protocol_schema()["$defs"]
    for name in ("Speak", "Cancel", "Ping", "Repeat", "Played", "Ready", "Queued", "Started", "Segment", "Words",
                 "Visemes", "Done", "Cancelled", "Pong", "Error", "Offer", "Answer"):
        assert name in schema
        assert f"`{name.lower()}`" in doc or f"`{name}`" in doc, f"docs/protocol.md does not mention {name}"


@pytest.mark.parametrize(("raw", "message"), [
    ('{"type": "speak", "id": "u1", "text": "Hello!"}', protocol.Speak(id="u1", text="Hello!")),
    ('{"type": "speak", "id": "u1", "text": "Hi", "voice": "leo", "interrupt": true, "more": true, "x": 1}',
     protocol.Speak(id="u1", text="Hi", voice="leo", interrupt=True, more=True)),
    ('{"type": "cancel"}', protocol.Cancel()),
    ('{"type": "cancel", "id": "u1"}', protocol.Cancel(id="u1")),
    ('{"type": "ping", "t": 12.5}', protocol.Ping(t=12.5)),
    ('{"type": "speak", "id": "u1", "text": "Devagar.", "rate": 0.7}',
     protocol.Speak(id="u1", text="Devagar.", rate=0.7)),
    ('{"type": "repeat", "id": "u1"}', protocol.Repeat(id="u1")),
    ('{"type": "repeat", "id": "u1", "new_id": "u1-slow", "from_word": 0, "to_word": 2, "rate": 0.5}',
     protocol.Repeat(id="u1", new_id="u1-slow", from_word=0, to_word=2, rate=0.5)),
    ('{"type": "played", "id": "u1", "played_ms": 1520}', protocol.Played(id="u1", played_ms=1520)),
])
def test_client_messages_parse_into_their_types(raw: str, message: object) -> None:
    parsed = parse_client_message(raw)
    assert parsed == message
    assert_valid("client_message", json.loads(raw))
    assert parse_client_message(protocol.encode(parsed)) == parsed  # what the headless client sends


@pytest.mark.parametrize(("raw", "code", "utterance_id"), [
    ("not json", "invalid_json", None),
    ("[1, 2]", "invalid_message", None),
    ('{"type": "dance"}', "unknown_type", None),
    ('{"text": "no type"}', "unknown_type", None),
    ('{"type": "speak", "text": "no id"}', "invalid_message", None),
    ('{"type": "speak", "id": 5, "text": "x"}', "invalid_message", None),
    ('{"type": "speak", "id": "", "text": "x"}', "invalid_message", None),
    ('{"type": "speak", "id": "u9"}', "invalid_message", "u9"),
    ('{"type": "speak", "id": "u9", "text": "hi", "interrupt": "yes"}', "invalid_message", "u9"),
    ('{"type": "cancel", "id": ' + json.dumps("x" * 200) + "}", "invalid_message", None),
        # Too deep to read even its id: refused without naming one (it was never accepted, so nothing is lost).
    ('{"type": "speak", "id": "u1", "text": ' + "[" * 5000 + "]" * 5000 + "}", "invalid_message", None),
    ('{"type": "ping", "x": ' + "[" * 5000 + "]" * 5000 + "}", "invalid_message", None),
    ("x" * (MAX_MESSAGE_BYTES + 1), "message_too_large", None),
    (b"\x00\x01binary", "invalid_message", None),
])
def test_bad_messages_get_a_named_error(raw: str | bytes, code: str, utterance_id: str | None) -> None:
    with pytest.raises(ProtocolError) as refused:
        parse_client_message(raw)
    assert refused.value.code == code and str(refused.value)
    assert refused.value.utterance_id == utterance_id


def test_events_encode_as_the_schema_says() -> None:
    events = [
        protocol.Ready(session_id="s", voices=["tara"], voice="tara", sample_rate=48000, jitter_buffer_ms=500),
        protocol.Queued(id="u1", position=0),
        protocol.Started(id="u1", ttfa_ms=41.5, ttft_ms=20.0, ttfw_ms=None),
        protocol.Segment(id="u1", index=0, text="Olá, tudo bem?"),
        protocol.Done(id="u1", audio_ms=1200.0, underruns=0, underrun_ms=0.0),
        protocol.Done(id="u1", audio_ms=1200.0, underruns=0, underrun_ms=0.0, played_ms=1200.0, heard_text="Olá",
                      last_word=0),
        protocol.Cancelled(id="u1"),
        protocol.Cancelled(id="u1", played_ms=640.0, heard_text="Olá, tudo", last_word=1),
        protocol.Queued(id="u1#r1", position=0, repeat_of="u1"),
        protocol.Words(id="u1", index=0, start_ms=0, rtp_timestamp=4294967000, source="aligned", first_word=0,
                       words=[protocol.Word(text="Olá", char_start=0, char_end=3, start_ms=40, duration_ms=300)]),
        protocol.Visemes(id="u1", index=0, start_ms=0, rtp_timestamp=None,
                         visemes=[protocol.Viseme(viseme="O", start_ms=40, duration_ms=100, word=0)]),
        protocol.Pong(t="a"),
        protocol.Error(code="queue_full", message="too many", id="u1"),
        protocol.Error(code="rate_limited", message="slow down", retry_after_s=2),
    ]
    for event in events:
        text = protocol.encode(event)
        assert_valid("server_event", json.loads(text))
        assert protocol.parse_server_event(text) == event
    assert "Olá" in protocol.encode(events[3]), "UTF-8 as it is, not escaped"
    assert "id" not in json.loads(protocol.encode(events[-1])), "an error about no utterance names none"


def test_schema_rejects_what_the_server_refuses() -> None:
    with pytest.raises(AssertionError):
        assert_valid("client_message", {"type": "speak", "id": "", "text": "x"})
    with pytest.raises(AssertionError):
        assert_valid("offer", {"sdp": "v=0", "type": "offer", "jitter_buffer_ms": 999_999})
