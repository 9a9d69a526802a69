"""The start-up checks: settings that cannot work are refused with a message naming the setting."""

from __future__ import annotations

import urllib.parse

from gateway.config.rules import (
    JITTER_BUFFER_MAX_MS,
    MIN_SECRET_CHARS,
    MIN_TURN_CREDENTIAL_TTL_S,
    PHRASE_CACHE_MODES,
    PHRASE_CACHE_SCHEMES,
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
from gateway.model_table import ModelTableError
from gateway.orpheus import AUDIO_TOKENS_PER_SECOND


def validate(config: GatewayConfig) -> None:
    """Reject settings that cannot work, with a message naming the setting."""
    checks = [
        (config.max_tokens >= 7, "max_tokens must be at least 7 (one SNAC frame)"),
        (config.max_tokens_per_char >= 0, "max_tokens_per_char must be >= 0"),
        (config.max_num_seqs >= 1, "max_num_seqs must be >= 1"),
        (0 < config.gpu_memory_utilization <= 1, "gpu_memory_utilization must be within (0, 1]"),
        (config.kv_cache_memory_gib is None or config.kv_cache_memory_gib > 0, "kv_cache_memory_gib must be > 0"),
        (all(n >= 0 for n in config.warmup_batch_sizes), "warmup_batch_sizes must be >= 0 (0 = skip)"),
        (0 <= config.jitter_buffer_ms <= JITTER_BUFFER_MAX_MS,
         f"jitter_buffer_ms must be within 0..{JITTER_BUFFER_MAX_MS}"),
        (config.snac_dtype in SNAC_DTYPES, f"snac_dtype must be one of {', '.join(SNAC_DTYPES)}"),
        (config.snac_placement in SNAC_PLACEMENTS, f"snac_placement must be one of {', '.join(SNAC_PLACEMENTS)}"),
        (config.snac_mps_priority in SNAC_MPS_PRIORITIES,
         f"snac_mps_priority must be one of {', '.join(SNAC_MPS_PRIORITIES)}"),
        (config.snac_mps_priority == "normal" or (config.workers > 1 and config.snac_placement == "shared"),
         "snac_mps_priority below-normal needs the shared SNAC process of --workers (workers > 1, snac_placement "
         "shared)"),
        (not (config.snac_kernels and config.snac_device == "cpu"),
         "snac_kernels needs SNAC on CUDA (snac_device auto or cuda), not cpu"),
        (config.decode_fast_start_ms >= 0, "decode_fast_start_ms must be >= 0"),
        (config.decode_max_batch >= 1, "decode_max_batch must be >= 1"),
        (config.snac_step_duty is None or step_duty_in_bounds(config.snac_step_duty),
         f"snac_step_duty must be within {STEP_DUTY_BOUNDS}"),
        (config.stream_interval >= 1, "stream_interval must be >= 1"),
        (config.temperature >= 0, "temperature must be >= 0"),
        (0 < config.top_p <= 1, "top_p must be within (0, 1]"),
        (config.max_text_chars >= 1, "max_text_chars must be >= 1"),
        (1 <= config.port <= 65535 or config.port == 0, "port must be within 0..65535"),
        (config.max_sessions >= 1, "max_sessions must be >= 1"),
        (config.workers >= 1, "workers must be >= 1"),
        (0 <= config.vllm_port <= 65535, "vllm_port must be within 0..65535"),
        (config.vllm_api_servers >= 0, "vllm_api_servers must be >= 0"),
        (6000 <= config.opus_bitrate <= 510000, "opus_bitrate must be within 6000..510000 (Opus' range)"),
        (0 <= config.opus_complexity <= 10, "opus_complexity must be within 0..10"),
        (config.max_in_flight_utterances >= 0, "max_in_flight_utterances must be >= 0 (0 = max_num_seqs)"),
        (config.engine_tokens_per_second == 0 or config.engine_tokens_per_second >= AUDIO_TOKENS_PER_SECOND,
         f"engine_tokens_per_second must be 0 (off) or at least {AUDIO_TOKENS_PER_SECOND:.2f} (one stream)"),
        (config.max_messages_per_second >= 0, "max_messages_per_second must be >= 0 (0 = no limit)"),
        (config.message_burst >= 1, "message_burst must be >= 1"),
        (config.replay_cache_utterances >= 0, "replay_cache_utterances must be >= 0 (0 = no repeat)"),
        (config.replay_cache_s >= 0, "replay_cache_s must be >= 0"),
        (config.phrase_cache in PHRASE_CACHE_MODES, f"phrase_cache must be one of {', '.join(PHRASE_CACHE_MODES)}"),
        (config.phrase_cache_bytes >= 1, "phrase_cache_bytes must be >= 1"),
        (config.phrase_cache_url is None
         or urllib.parse.urlsplit(config.phrase_cache_url).scheme in PHRASE_CACHE_SCHEMES,
         f"phrase_cache_url must be a {'/'.join(PHRASE_CACHE_SCHEMES)} url such as redis://cache:6379/0"),
        (config.session_idle_timeout_s >= 0, "session_idle_timeout_s must be >= 0"),
        (config.heartbeat_timeout_s >= 0, "heartbeat_timeout_s must be >= 0 (0 = off)"),
        (config.session_connect_timeout_s >= 0, "session_connect_timeout_s must be >= 0 (0 = off)"),
        (config.max_session_s >= 0, "max_session_s must be >= 0 (0 = no limit)"),
        (config.vllm_read_timeout_s > 0, "vllm_read_timeout_s must be > 0"),
        (all(len(t) >= MIN_SECRET_CHARS for t in config.auth_token),
         f"auth_token: each token must have at least {MIN_SECRET_CHARS} characters"),
        (all(len(s) >= MIN_SECRET_CHARS for s in config.auth_secret),
         f"auth_secret: each secret must have at least {MIN_SECRET_CHARS} characters"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    _validate_ice(config)
    for url in config.vllm_urls:
        if not _is_base_url(url):
            raise ConfigError(f"vllm_urls: {url!r} is not an http(s) base URL such as http://gpu1:8001")
    if len({url.rstrip("/") for url in config.vllm_urls}) != len(config.vllm_urls):
        raise ConfigError(f"vllm_urls: a server is listed twice: {list(config.vllm_urls)}")
    for origin in config.allowed_origin:
        try:
            normalize_origin(origin)
        except ValueError as exc:
            raise ConfigError(f"allowed_origin: {exc}") from None
    _validate_models(config)
    if config.default_voice is not None and config.default_voice not in config.voice_list:
        raise ConfigError(f"default_voice {config.default_voice!r} is not among the voices {config.voice_list}")
    for item in config.voice_alias:
        try:
            name, voice = parse_voice_alias(item)
        except ValueError as exc:
            raise ConfigError(f"voice_alias: {exc}") from None
        if voice not in config.voice_list:
            raise ConfigError(f"voice_alias {item!r}: {voice!r} is not among the voices {config.voice_list}")
        if name in config.voice_list:
            raise ConfigError(f"voice_alias {item!r}: {name!r} is a voice itself")


def _validate_models(config: GatewayConfig) -> None:
    """The table of models builds (names, voices unique, languages, shares), and its settings fit the layout."""
    try:
        table = config.model_table
    except ModelTableError as exc:
        raise ConfigError(str(exc)) from None
    if len(table.bases) == 1:
        return
    if config.voices:
        raise ConfigError("voices: with several models, each model's voices are set in --models-file")
    shares = [spec.gpu_memory_utilization for spec in table.bases.values() if spec.gpu_memory_utilization]
    if sum(shares) > 1:
        raise ConfigError(f"models: the gpu_memory_utilization shares add up to {sum(shares):g}, more than 1")
    for spec in table.bases.values():
        for url in spec.vllm_urls:
            if not _is_base_url(url):
                raise ConfigError(f"model {spec.name!r}: vllm_urls: {url!r} is not an http(s) base URL")
    remote = [bool(spec.vllm_urls) for spec in table.bases.values()]
    if config.vllm_urls:
        raise ConfigError("vllm_urls: with several models, list each model's servers (vllm_urls) in --models-file")
    if any(remote) and not all(remote):
        raise ConfigError("models: either every model lists its vllm_urls (remote servers) or none does")


def _validate_ice(config: GatewayConfig) -> None:
    """STUN/TURN settings: urls a browser accepts, and exactly one source of TURN credentials when TURN is used."""
    for url in config.ice_servers:
        try:
            check_ice_url(url)
        except ValueError as exc:
            raise ConfigError(f"ice_servers: {exc}") from None
    static = (config.ice_username is not None, config.ice_credential is not None)
    if static[0] != static[1]:
        raise ConfigError("ice_username and ice_credential: set both (static TURN credentials) or neither")
    if config.turn_secret is not None:
        if len(config.turn_secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"turn_secret must have at least {MIN_SECRET_CHARS} characters")
        if all(static):
            raise ConfigError("turn_secret and ice_username/ice_credential: set one source of TURN credentials, "
                              "not both")
    # Shorter ones fail on the clock difference between the gateway's and coturn's hosts.
    if config.turn_credential_ttl_s < MIN_TURN_CREDENTIAL_TTL_S:
        raise ConfigError(f"turn_credential_ttl_s must be at least {MIN_TURN_CREDENTIAL_TTL_S} (seconds)")
    turn = [url for url in config.ice_servers if is_turn_url(url)]
    if turn and config.turn_secret is None and not all(static):
        # Browsers refuse a TURN server without credentials (RTCPeerConnection throws), aiortc cannot allocate.
        raise ConfigError(f"ice_servers: {turn[0]!r} needs credentials: set turn_secret (time-limited, "
                          "recommended) or ice_username and ice_credential")


def _is_base_url(url: str) -> bool:
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError for a port out of range or not a number
    except ValueError:
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and not (parts.query or parts.fragment)
