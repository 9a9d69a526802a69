"""What every WebRTC session of a process shares, handed in once by the app that builds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gateway.config import GatewayConfig
from gateway.phrases.cache import PhraseCache
from gateway.service.admission import Admission
from gateway.service.metrics import Metrics
from gateway.speech.synthesizer import Synthesizer


@dataclass(frozen=True)
class SessionServices:
    """The configuration, metrics and admission of this process, its synthesizer once it is loaded
    (`synthesizer()` is None while the engine starts) and its phrase cache."""

    config: GatewayConfig
    metrics: Metrics
    admission: Admission
    synthesizer: Callable[[], Synthesizer | None]
    phrases: PhraseCache | None = None  # the phrase cache (`--phrase-cache`), None when off
