"""The bounds, choices and value rules the settings share with the code that uses them (one home each), and the
error a setting that cannot work raises."""

from __future__ import annotations

import re
import urllib.parse

MIN_TURN_CREDENTIAL_TTL_S = 60
SNAC_DTYPES = ("auto", "float32", "bfloat16", "float16")
SNAC_PLACEMENTS = ("process", "shared")
SNAC_MPS_PRIORITIES = {"normal": "0", "below-normal": "1"}  # --snac-mps-priority -> CUDA_MPS_CLIENT_PRIORITY
PHRASE_CACHE_MODES = ("off", "marked", "all")  # what the phrase cache keeps: nothing, `cache: true` lines, every line
PHRASE_CACHE_SCHEMES = ("redis", "rediss", "unix")
# OpenAI's speech voices, which OpenAI clients (pipecat's OpenAITTSService) accept and send; each is an alias of a
# served voice by default (`GatewayConfig.voice_aliases`). English checkpoints get voices of a like register.
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")
OPENAI_ENGLISH = {"alloy": "tara", "ash": "dan", "ballad": "leo", "cedar": "zac", "coral": "jess", "echo": "leo",
                  "fable": "dan", "marin": "mia", "nova": "leah", "onyx": "zac", "sage": "zoe", "shimmer": "mia",
                  "verse": "leo"}
JITTER_BUFFER_MAX_MS = 5000  # the one bound of a session's jitter buffer (flag, offer, WHEP query, page)
MIN_SECRET_CHARS = 16  # shorter static tokens or HMAC secrets are guessable; refused at start-up
ANY_ORIGIN = "*"
ORIGIN_SCHEMES = ("http", "https")
TURN_SCHEMES = ("turn", "turns")
_HOST = r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?)"
# RFC 7064 (stun, stuns) and RFC 7065 (turn, turns): the forms RTCPeerConnection accepts; only TURN has a transport.
_STUN_URL = re.compile(rf"^stuns?:{_HOST}(:\d{{1,5}})?$")
_TURN_URL = re.compile(rf"^turns?:{_HOST}(:\d{{1,5}})?(\?transport=(udp|tcp))?$")


class ConfigError(ValueError):
    """A setting that cannot work; the message names it."""


STEP_DUTY_BOUNDS = "(0, 1]"


def step_duty_in_bounds(duty: float) -> bool:
    """The SNAC decoder's step duty (`snac_step_duty`, `StreamDecoder(step_duty=)`): a share of the wall time."""
    return 0 < duty <= 1


def normalize_origin(origin: str) -> str:
    """`scheme://host[:port]` in lower case (what browsers send in `Origin`), or `*`; else ValueError."""
    if origin == ANY_ORIGIN:
        return origin
    parts = urllib.parse.urlsplit(origin.strip().rstrip("/").lower())
    if parts.scheme not in ORIGIN_SCHEMES or not parts.netloc or parts.path or parts.query or parts.fragment:
        raise ValueError(f"{origin!r} is not an origin like https://school.example or http://localhost:8000")
    return f"{parts.scheme}://{parts.netloc}"


def parse_voice_alias(item: str) -> tuple[str, str]:
    """`NAME=VOICE` -> (name, voice); ValueError for any other form."""
    name, sep, voice = item.partition("=")
    name, voice = name.strip(), voice.strip()
    if not sep or not name or not voice:
        raise ValueError(f"{item!r} is not NAME=VOICE, e.g. alloy=tara")
    return name, voice


def check_ice_url(url: str) -> None:
    """ValueError unless `url` is a stun:/stuns:/turn:/turns: url a browser accepts."""
    pattern = _TURN_URL if url.startswith("turn") else _STUN_URL
    match = pattern.match(url)
    port = match.group(2) if match else None
    if match is None or (port is not None and not 1 <= int(port[1:]) <= 65535):
        raise ValueError(f"{url!r} is not a STUN/TURN url like stun:host:3478 or turn:host:3478?transport=udp")


def is_turn_url(url: str) -> bool:
    return url.split(":", 1)[0] in TURN_SCHEMES
