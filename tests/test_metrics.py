"""Merging several gateway processes' metrics into one exposition (`serve --workers`), and the event-loop lag
they report."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gateway.benchmarks.gateway_procs import (
    METRICS_ATTEMPTS,
    GatewayWatch,
    all_processes_answered,
    loop_lag_buckets,
    loop_lag_summary,
)
from gateway.service.loop_lag import LoopLagMonitor
from gateway.service.metrics import Metrics, SnacMetrics, merge_worker_expositions
from tests.support import free_port


def test_merged_exposition_labels_every_sample_with_its_worker() -> None:
    first, second = Metrics(), Metrics()
    first.sessions_total.inc(3)
    second.sessions_total.inc(2)
    second.sessions_active.set(4)
    first.ttfa_seconds.labels("webrtc").observe(0.1)
    second.ttfa_seconds.labels("webrtc").observe(0.3)
    merged = merge_worker_expositions({"w0": first.render().decode(), "w1": second.render().decode()})
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}

    assert families["orpheus_sessions"].type == "counter"
    opened = {s.labels["worker"]: s.value for s in families["orpheus_sessions"].samples if s.name.endswith("_total")}
    assert opened == {"w0": 3.0, "w1": 2.0}
    active = {s.labels["worker"]: s.value for s in families["orpheus_sessions_active"].samples}
    assert active == {"w0": 0.0, "w1": 4.0}
    ttfa = families["orpheus_time_to_first_audio_seconds"]
    assert ttfa.type == "histogram"
    counts = {s.labels["worker"]: s.value for s in ttfa.samples if s.name.endswith("_count")}
    assert counts == {"w0": 1.0, "w1": 1.0}
    assert all(s.labels["path"] == "webrtc" for s in ttfa.samples), "the samples' own labels are kept"


def test_one_worker_merges_to_its_own_figures() -> None:
    only = Metrics()
    only.underruns_total.inc(7)
    families = {f.name: f for f in text_string_to_metric_families(
        merge_worker_expositions({"w0": only.render().decode()}).decode())}
    (total,) = [s for s in families["orpheus_underruns"].samples if s.name.endswith("_total")]
    assert (total.labels, total.value) == ({"worker": "w0"}, 7.0)


def test_worker_count_family_says_how_many_answered() -> None:
    merged = merge_worker_expositions({"w0": Metrics().render().decode()}, expected=2)
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}
    assert {s.labels["state"]: s.value for s in families["orpheus_metrics_workers"].samples} == \
        {"answered": 1.0, "expected": 2.0}


def test_a_merged_read_missing_a_process_is_read_again_by_the_bench() -> None:
    """A worker or the shared SNAC process that did not answer a merged read is missing from it, so a benchmark
    that differences two readings reads again (a missing SNAC process read as zero steps)."""
    workers = {"w0": Metrics().render().decode(), "w1": Metrics().render().decode()}
    whole = merge_worker_expositions({**workers, "snac": Metrics().render().decode()}, expected=2, answered=2,
                                     snac_answered=True).decode()
    families = {f.name: f for f in text_string_to_metric_families(whole)}
    assert {s.labels["state"]: s.value for s in families["orpheus_metrics_snac_process"].samples} == \
        {"answered": 1.0, "expected": 1.0}
    assert all_processes_answered(whole)
    assert not all_processes_answered(merge_worker_expositions(workers, expected=2, answered=2,
                                                               snac_answered=False).decode())
    assert not all_processes_answered(merge_worker_expositions({"w0": workers["w0"]}, expected=2).decode())
    assert all_processes_answered(Metrics().render().decode()), "a single gateway's own /metrics is whole"


async def test_the_bench_takes_no_snac_counters_from_a_read_that_stays_short() -> None:
    """Over HTTP: a merged /metrics that lacks the SNAC process on every read gives the bench no counters (it reads
    METRICS_ATTEMPTS times); one that is whole by the last read gives them."""
    snac = SnacMetrics(CollectorRegistry())  # the shared SNAC process's own registry
    snac.snac_new_frames_total.inc(5)
    workers = {"w0": Metrics().render().decode()}
    reads: list[int] = []
    whole_from = [METRICS_ATTEMPTS + 1]

    async def metrics(_request: web.Request) -> web.Response:
        reads.append(1)
        answered = len(reads) >= whole_from[0]
        processes = {**workers, "snac": generate_latest(snac.registry).decode()} if answered else workers
        body = merge_worker_expositions(processes, expected=1, answered=1, snac_answered=answered)
        return web.Response(body=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        watch = GatewayWatch(f"http://127.0.0.1:{port}", None)
        short = await watch.snapshot()
        assert len(reads) == METRICS_ATTEMPTS and short.snac is None and short.loop_lag is None
        reads.clear()
        whole_from[0] = METRICS_ATTEMPTS
        whole = await watch.snapshot()
        assert len(reads) == METRICS_ATTEMPTS and whole.snac is not None and whole.snac["frames"] == 5
    finally:
        await runner.cleanup()


async def test_a_blocked_loop_shows_in_the_lag_histogram_and_the_benchs_reading() -> None:
    """A loop blocked for 150 ms shows one sample in the 100-200 ms bucket; a worker whose loop ran free shows none
    over 10 ms; the bench reads the merged workers' histogram as samples, count over 10 ms and bucket bounds."""
    busy, free = Metrics(), Metrics()
    busy.loop_lag_seconds.observe(0.0005)  # an earlier sample: the bench reads the difference
    before = loop_lag_buckets(merge_worker_expositions({"w0": busy.render().decode(),
                                                        "w1": free.render().decode()}).decode())["workers"]
    monitor = LoopLagMonitor(busy.loop_lag_seconds.observe)
    monitor.start()
    await asyncio.sleep(0.05)
    asyncio.get_running_loop().call_soon(time.sleep, 0.15)  # a callback that holds the loop
    await asyncio.sleep(0.25)
    await monitor.stop()
    after = loop_lag_buckets(merge_worker_expositions({"w0": busy.render().decode(),
                                                       "w1": free.render().decode()}).decode())["workers"]
    summary = loop_lag_summary(before, after)
    assert summary is not None and summary["samples"] >= 3
    # The block's sample is there; a loaded machine may add lags of its own, never take one away.
    assert summary["over_10ms"] >= 1 and summary["max_le_ms"] >= 200.0, summary
    assert loop_lag_summary(after, after) is None  # nothing sampled between two readings


def test_the_benchs_reading_of_the_lag_histogram() -> None:
    """The reading rule on known samples: the difference of two readings, the count over 10 ms and the upper
    bound of the largest sample's bucket; a worker with no samples adds nothing."""
    busy, free = Metrics(), Metrics()
    busy.loop_lag_seconds.observe(0.0005)

    def reading() -> dict[str, object]:
        merged = merge_worker_expositions({"w0": busy.render().decode(), "w1": free.render().decode()})
        return loop_lag_buckets(merged.decode())["workers"]

    before = reading()
    for lag_s in (0.0005, 0.002, 0.15):
        busy.loop_lag_seconds.observe(lag_s)
    summary = loop_lag_summary(before, reading())
    assert summary is not None
    assert (summary["samples"], summary["over_10ms"], summary["max_le_ms"]) == (3, 1, 200.0)
