"""The speech layer's exceptions, in one place: what a generation request can end with (`EngineError` and its
kinds, each with the code and retry hint the front ends report), a request the synthesizer refuses, a checkpoint
that cannot be found, a `vllm serve` server that cannot take a request, and a codec connection that broke the
SNAC stream protocol.
"""

from __future__ import annotations

from gateway.config import ConfigError

# What a client is told to wait before asking again while the engine (re)starts: a restart takes tens of seconds,
# and clients that ask every second only add load (docs/decisions/remote-engine.md).
ENGINE_RETRY_AFTER_S = 5


class EngineError(RuntimeError):
    """Base of the errors a generation request can end with; `retry_after_s`: when asking again makes sense."""

    code = "engine_error"
    retry_after_s: int | None = None


class EngineUnavailableError(EngineError):
    """The engine is starting or restarting; try again shortly."""

    code = "engine_unavailable"
    retry_after_s = ENGINE_RETRY_AFTER_S


class EngineDeadError(EngineError):
    """The engine died while this request was running; it is being restarted."""

    code = "engine_dead"
    retry_after_s = ENGINE_RETRY_AFTER_S


class EngineRequestError(EngineError):
    """The engine refused this request as invalid (e.g. longer than the model's context); retrying will not help."""

    code = "engine_rejected"


class ServerUnusableError(Exception):
    """A `vllm serve` server cannot take this request (unreachable, unhealthy, serving another model); another one
    may (`remote.RemoteEngine` tries the next)."""


class InvalidRequestError(ValueError):
    """A request the synthesizer refuses (unknown voice, empty or too long text)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class CheckpointNotFoundError(ConfigError):
    """A model, tokenizer or codec that is neither a local folder nor to be had from the hub."""


class CodecWireError(RuntimeError):
    """A codec client sent something that is not a message of the SNAC stream protocol (`codec.wire`): its
    connection is closed."""
