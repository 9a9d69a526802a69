"""Merging several gateway processes' metrics into one exposition (`serve --workers`)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from gateway.service.metrics import Metrics, merge_worker_expositions


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
