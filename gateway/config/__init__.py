"""The gateway's one configuration object: its settings, the flags and variables that fill them, their checks.

Owns `GatewayConfig` (settings.py), the bounds and value rules the settings share with the code that uses them
(rules.py), the start-up checks that reject what cannot work (checks.py), and the sources (sources.py): every field
is a CLI flag (`--max-num-seqs`; a field may name its own, e.g. `vllm_urls` is `--vllm-url`) and an environment
variable (`ORPHEUS_GATEWAY_MAX_NUM_SEQS`; lists and tuples are comma-separated there); the flag wins over the
variable, the variable over the default in settings.py. `orpheus-gateway serve --help` prints every field with its
default. May import: gateway.model_table and gateway.orpheus.
"""

from gateway.config.checks import validate
from gateway.config.rules import (
    ANY_ORIGIN,
    JITTER_BUFFER_MAX_MS,
    MIN_SECRET_CHARS,
    OPENAI_VOICES,
    PHRASE_CACHE_MODES,
    SNAC_DTYPES,
    SNAC_MPS_PRIORITIES,
    SNAC_PLACEMENTS,
    STEP_DUTY_BOUNDS,
    ConfigError,
    check_ice_url,
    is_turn_url,
    normalize_origin,
    parse_voice_alias,
    step_duty_in_bounds,
)
from gateway.config.settings import GatewayConfig
from gateway.config.sources import ENV_PREFIX, add_arguments, from_sources

__all__ = [
    "ANY_ORIGIN", "ENV_PREFIX", "JITTER_BUFFER_MAX_MS", "MIN_SECRET_CHARS", "OPENAI_VOICES", "PHRASE_CACHE_MODES",
    "SNAC_DTYPES", "SNAC_MPS_PRIORITIES", "SNAC_PLACEMENTS", "STEP_DUTY_BOUNDS", "ConfigError", "GatewayConfig",
    "add_arguments", "check_ice_url", "from_sources", "is_turn_url", "normalize_origin", "parse_voice_alias",
    "step_duty_in_bounds", "validate",
]
