"""Process services every front end shares: admission (how many sessions and utterances may run, message
rates), Prometheus metrics and the event loop's health.

Owns: `Admission`, `Slot`, `TokenBucket`, `StreamCounts` (admission.py), `CapacityError` (errors.py), `Metrics`
(metrics.py) and `LoopLagMonitor` (loop_lag.py: how late the process's event loop wakes).
May import: `gateway.config`, `gateway.orpheus`, the standard library, prometheus_client. Nothing above it; it
is a sibling of `gateway.speech` and `gateway.media` and knows neither.
"""
