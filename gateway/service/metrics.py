"""Prometheus metrics of one gateway process, served at `GET /metrics`.

Imports prometheus_client only: every layer above reports here, none is reached from here.

Each gateway owns its registry (not the global one) so several apps can live in one process (tests). Under
`serve --workers` any worker answers `/metrics` for all of them (`merge_worker_expositions`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

from prometheus_client import CONTENT_TYPE_LATEST as PROMETHEUS_CONTENT_TYPE
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from gateway.service.errors import CapacityError

LATENCY_BUCKETS_S = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
RTF_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
PLAYED_BUCKETS_S = (0.5, 1.0, 2.0, 3.0, 5.0, 8.0, 13.0, 20.0, 30.0, 60.0)
# Event-loop lag: 10 ms and more makes a playout frame late (`orpheus_playout_late_frames_total`); a listener
# without a buffer hears 20 ms and more.
LOOP_LAG_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)
LOOP_LAG_METRIC = "orpheus_event_loop_lag_seconds"
# Generation pace a first audio was planned at, seconds per 7-token frame: real time is 0.085; a loaded GPU makes
# one every 0.04-0.08 (docs/decisions/first-audio-start.md).
PACE_BUCKETS_S = (0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.085, 0.1, 0.15, 0.2, 0.3)
FIRST_AUDIO_HOLD_METRIC = "orpheus_snac_first_audio_hold_seconds"
START_LABEL = "start"  # where a first audio came from: "exact" (the exact stream) or "bridge"
CONTENT_TYPE = PROMETHEUS_CONTENT_TYPE
WORKER_LABEL = "worker"
METRICS_WORKERS_METRIC = "orpheus_metrics_workers"  # merged /metrics: workers expected and answered
SNAC_PROCESS_METRIC = "orpheus_metrics_snac_process"  # merged /metrics: the shared SNAC process, and if it answered
METRICS_PATH = "/metrics"


def loop_lag_histogram(registry: CollectorRegistry) -> Histogram:
    """`orpheus_event_loop_lag_seconds` in this registry: a gateway process's loop, or the shared SNAC process's
    streams loop (`service.loop_lag.LoopLagMonitor` feeds it)."""
    return Histogram(LOOP_LAG_METRIC, "How late the event loop woke from a 20 ms sleep.", buckets=LOOP_LAG_BUCKETS_S,
                     registry=registry)


class DecoderHooks(Protocol):
    """What `SnacMetrics.watch` sets on a SNAC decoder (`StreamDecoder`, or the codec client standing in for it)."""

    on_batch: Callable[[int, float, int, int], None] | None
    on_first_audio: Callable[[bool, float, float | None], None] | None


class SnacMetrics:
    """The SNAC decoder's passes: in a gateway's registry, or alone in the shared SNAC process of `serve --workers`
    (`gateway.cluster.snac_process`), whose metrics the workers' `/metrics` gathers with theirs."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = self.registry = registry
        self.snac_batch_size = Histogram("orpheus_snac_batch_size", "Streams per SNAC step.",
                                         buckets=BATCH_BUCKETS, registry=r)
        self.snac_batch_seconds = Histogram("orpheus_snac_batch_seconds", "Duration of one SNAC step.",
                                            buckets=LATENCY_BUCKETS_S, registry=r)
        self.snac_windows_total = Counter("orpheus_snac_windows_total", "Stream-steps SNAC ran, by frames per "
                                          "stream and step (1: the exact decoder steps each stream one frame).",
                                          ["frames"], registry=r)
        self.snac_new_frames_total = Counter("orpheus_snac_new_frames_total", "Audio frames SNAC emitted.",
                                             registry=r)
        self.snac_first_audio_hold_seconds = Histogram(
            FIRST_AUDIO_HOLD_METRIC, "From a sentence's first frames ready to its first audio decoded, by where "
            "the audio came from (the start's hold for its listener's sake, and the wait for the decode).",
            [START_LABEL], buckets=LATENCY_BUCKETS_S, registry=r)
        self.snac_start_pace_seconds = Histogram(
            "orpheus_snac_start_pace_seconds", "Seconds per frame of generation a first audio was planned at.",
            buckets=PACE_BUCKETS_S, registry=r)

    def watch(self, decoder: DecoderHooks) -> None:
        """Report this decoder's steps and first audios here."""
        decoder.on_batch = self.observe_decode_batch
        decoder.on_first_audio = self.observe_first_audio

    def observe_decode_batch(self, size: int, seconds: float, window_frames: int, new_frames: int) -> None:
        """Called from the SNAC worker thread after each step (`size` streams of `window_frames` frames each);
        prometheus-client metrics are thread safe."""
        self.snac_batch_size.observe(size)
        self.snac_batch_seconds.observe(seconds)
        self.snac_windows_total.labels(frames=str(window_frames)).inc(size)
        self.snac_new_frames_total.inc(new_frames)

    def observe_first_audio(self, exact: bool, hold_s: float, pace_s: float | None) -> None:
        """Called from the SNAC worker thread when a sentence's first audio is decoded."""
        self.snac_first_audio_hold_seconds.labels(**{START_LABEL: "exact" if exact else "bridge"}).observe(hold_s)
        if pace_s is not None:
            self.snac_start_pace_seconds.observe(pace_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class PhraseCacheMetrics:
    """The phrase cache (`gateway.phrases`): sentences played from it or made for it, what it holds, and its store's
    failures (a Redis that is down: every lookup a miss)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.hits_total = Counter("orpheus_phrase_cache_hits_total", "Sentences played from the phrase cache.",
                                  registry=r)
        self.misses_total = Counter("orpheus_phrase_cache_misses_total", "Cacheable sentences not in the phrase "
                                    "cache (generated).", registry=r)
        self.joins_total = Counter("orpheus_phrase_cache_single_flight_joins_total", "Sentences that followed "
                                   "another request's generation of the same key instead of their own.", registry=r)
        self.stored_total = Counter("orpheus_phrase_cache_stored_total", "Sentences written to the phrase cache.",
                                    registry=r)
        self.bytes = Gauge("orpheus_phrase_cache_bytes", "Bytes the phrase cache's store holds (as last read).",
                           registry=r)
        self.evictions_total = Counter("orpheus_phrase_cache_evictions_total", "Entries evicted to keep the byte "
                                       "bound.", registry=r)
        self.prefetches_total = Counter("orpheus_phrase_cache_prefetches_total", "Prefetched sentences, by outcome "
                                        "(ready: already cached; generated; skipped: no room or cache off).",
                                        ["outcome"], registry=r)
        self.prefetch_tokens_total = Counter("orpheus_phrase_cache_prefetch_tokens_total", "Audio tokens generated "
                                             "by prefetches that no request followed (one that did counts them with "
                                             "its utterance's, in orpheus_audio_tokens_total).", registry=r)
        self.corrupt_total = Counter("orpheus_phrase_cache_corrupt_total", "Entries dropped for a bad checksum.",
                                     registry=r)
        self.errors_total = Counter("orpheus_phrase_cache_store_errors_total", "Store calls that failed (counted "
                                    "as misses), by store.", ["store"], registry=r)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.sessions_active = Gauge("orpheus_sessions_active", "WebRTC sessions open.", registry=r)
        self.sessions_total = Counter("orpheus_sessions_total", "WebRTC sessions opened.", registry=r)
        self.utterances_total = Counter("orpheus_utterances_total", "Utterances by outcome.", ["outcome"],
                                        registry=r)
        self.speech_requests_total = Counter("orpheus_speech_requests_total",
                                             "HTTP /v1/audio/speech requests by status.", ["status"], registry=r)
        self.stream_contexts_total = Counter("orpheus_stream_contexts_total", "Contexts of the streaming "
                                             "WebSocket door ended, by outcome (done, cancelled, failed).",
                                             ["outcome"], registry=r)
        self.ttfa_seconds = Histogram("orpheus_time_to_first_audio_seconds",
                                      "Request (speak message or HTTP request) to first audio out.",
                                      ["path"], buckets=LATENCY_BUCKETS_S, registry=r)
        self.rtf = Histogram("orpheus_real_time_factor", "Synthesis time / audio time per utterance.",
                             buckets=RTF_BUCKETS, registry=r)
        self.underruns_total = Counter("orpheus_underruns_total", "Playout underruns mid-utterance.",
                                       registry=r)
        self.underrun_seconds_total = Counter("orpheus_underrun_seconds_total",
                                              "Silence inserted mid-utterance by underruns.", registry=r)
        # The server's share of delivery jitter: audio frames its playout handed to the sender over 10 ms after
        # their 20 ms slot (a busy event loop), which listeners' jitter buffers must absorb.
        self.late_frames_total = Counter("orpheus_playout_late_frames_total",
                                         "Audio frames handed to the sender over 10 ms after their slot.",
                                         registry=r)
        # Why frames are late: how late this process's event loop woke from a 20 ms sleep (service.loop_lag).
        self.loop_lag_seconds = loop_lag_histogram(r)
        self.queue_depth = Gauge("orpheus_queued_utterances", "Utterances waiting in session queues.",
                                 registry=r)
        self.engine_in_flight = Gauge("orpheus_engine_requests_in_flight", "Engine requests running.",
                                      registry=r)
        self.engine_ready = Gauge("orpheus_engine_ready", "1 when the engine can serve.", registry=r)
        self.engine_restarts_total = Counter("orpheus_engine_restarts_total", "Engine restarts after death.",
                                             registry=r)
        self.snac = SnacMetrics(r)  # empty under `serve --workers`: the shared SNAC process reports them
        self.tokens_total = Counter("orpheus_audio_tokens_total",
                                    "Audio tokens of the utterances served (rate = tokens/s).", registry=r)
        self.audio_seconds_total = Counter("orpheus_audio_seconds_total", "Audio produced.", registry=r)
        # Refusals by error code (at_capacity, rate_limited, missing_token, ...): the operator's overload signal.
        self.rejections_total = Counter("orpheus_rejections_total", "Requests and messages refused, by code.",
                                        ["code"], registry=r)
        self.model_refusals_total = Counter("orpheus_model_refusals_total", "Utterances refused at their model's "
                                            "own limit (several models served).", ["model"], registry=r)
        # Lessons: how word timings were made (aligned vs estimated: how often the aligner was busy or late),
        # and what the pages say they played (`played` messages: the student's side of the heard report).
        self.word_timings_total = Counter("orpheus_word_timings_total", "Sentences given word timings, by source "
                                          "(aligned, estimated).", ["source"], registry=r)
        self.client_played_seconds = Histogram("orpheus_client_played_seconds", "Audio of an utterance the page "
                                               "reports it played (`played` messages).", buckets=PLAYED_BUCKETS_S,
                                               registry=r)

        self.phrases = PhraseCacheMetrics(r)
        self._models: _ModelCollector | None = None

    def refused(self, error: CapacityError) -> None:
        """A request or utterance refused at capacity: by its code, and by model where its model's limit was hit."""
        self.rejections_total.labels(error.code).inc()
        if error.model is not None:
            self.model_refusals_total.labels(error.model).inc()

    def observe_synthesis(self, tokens: int, audio_s: float, synthesis_s: float | None) -> None:
        """One utterance made (HTTP or WebRTC): its tokens, its audio and, when it has audio, its real-time factor
        (`synthesis_s`: request to last audio made)."""
        self.tokens_total.inc(tokens)
        self.audio_seconds_total.inc(audio_s)
        if audio_s > 0 and synthesis_s is not None:
            self.rtf.observe(synthesis_s / audio_s)

    def track_in_flight(self, read: Callable[[], float]) -> None:
        self.engine_in_flight.set_function(read)

    def track_models(self, read: Callable[[], Mapping[str, ModelEngineStats]]) -> None:
        """Per-model engine metrics (several checkpoints on one gateway), read at each scrape."""
        if self._models is None:
            self._models = _ModelCollector(read)
            self.registry.register(self._models)
        else:
            self._models.read = read

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelEngineStats(Protocol):
    """One served model's engine, as `/metrics` shows it."""

    @property
    def ready(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def requests(self) -> int: ...
    @property
    def tokens(self) -> int: ...


class _ModelCollector:
    """`orpheus_model_engine_ready`, `orpheus_model_requests_in_flight`, `orpheus_model_requests_total` and
    `orpheus_model_audio_tokens_total`, labelled by model."""

    def __init__(self, read: Callable[[], Mapping[str, ModelEngineStats]]) -> None:
        self.read = read

    def collect(self) -> list[Metric]:
        ready = GaugeMetricFamily("orpheus_model_engine_ready", "1 when the model's engine can serve.",
                                  labels=["model"])
        in_flight = GaugeMetricFamily("orpheus_model_requests_in_flight", "The model's engine requests running.",
                                      labels=["model"])
        requests = CounterMetricFamily("orpheus_model_requests", "Engine requests sent to the model.",
                                       labels=["model"])
        tokens = CounterMetricFamily("orpheus_model_audio_tokens", "Audio tokens the model generated.",
                                     labels=["model"])
        for name, stats in self.read().items():
            ready.add_metric([name], 1.0 if stats.ready else 0.0)
            in_flight.add_metric([name], stats.in_flight)
            requests.add_metric([name], stats.requests)
            tokens.add_metric([name], stats.tokens)
        return [ready, in_flight, requests, tokens]


class _Families:
    """Metric families to render with `generate_latest` (it only needs `collect()`)."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def merge_worker_expositions(texts: Mapping[str, str], expected: int | None = None,
                             answered: int | None = None, snac_answered: bool | None = None) -> bytes:
    """One exposition of several gateway processes' metrics (`serve --workers`), each sample labelled
    `worker="<name>"`: `sum by (...)` in Prometheus gives the gateway-wide figure. With `expected`, also
    `orpheus_metrics_workers{state}`: how many workers there are and how many answered (`answered`: when
    `texts` also holds a process that is not a worker, the shared SNAC process). With `snac_answered` (there is a
    shared SNAC process), `orpheus_metrics_snac_process{state}` likewise: a reader that compares counters across
    two readings skips one where a process did not answer."""
    merged: dict[str, Metric] = {}
    for worker, text in texts.items():
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            target.samples += [Sample(s.name, {**s.labels, WORKER_LABEL: worker}, s.value, s.timestamp, s.exemplar)
                               for s in family.samples]
    if expected is not None:
        workers = GaugeMetricFamily(METRICS_WORKERS_METRIC, "Gateway workers (Unix sockets) and how many "
                                    "answered here.", labels=["state"])
        workers.add_metric(["answered"], len(texts) if answered is None else answered)
        workers.add_metric(["expected"], expected)
        merged[workers.name] = workers
    if snac_answered is not None:
        snac = GaugeMetricFamily(SNAC_PROCESS_METRIC, "The shared SNAC process, and whether it answered here.",
                                 labels=["state"])
        snac.add_metric(["answered"], int(snac_answered))
        snac.add_metric(["expected"], 1)
        merged[snac.name] = snac
    return generate_latest(_Families(list(merged.values())))  # type: ignore[arg-type]
