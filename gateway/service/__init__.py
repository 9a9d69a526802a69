"""Process services every front end shares: admission (how many sessions and utterances may run, message
rates) and Prometheus metrics.

Owns: `Admission`, `Slot`, `TokenBucket`, `CapacityError` (admission.py) and `Metrics` (metrics.py).
May import: `gateway.config`, `gateway.orpheus`, the standard library, prometheus_client. Nothing above it; it
is a sibling of `gateway.speech` and `gateway.media` and knows neither.
"""
