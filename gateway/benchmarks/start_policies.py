"""The first-audio start policies the benchmarks compare with the gateway's own (`first_audio.EXACT_OR_BRIDGE`): a
held bridge only (`BRIDGE_HELD`: the bridged start planned at the measured pace, never the exact stream) and the
bridge at once (`BRIDGE_AT_ONCE`: no hold; `fast_start` runs in dilated time, where the wall-clock pace a hold reads
is not the model's). The gateway itself uses neither.
"""

from __future__ import annotations

from gateway.speech.first_audio import EXACT_OR_BRIDGE, StartPolicy, start_hold_s

BRIDGE_HELD = StartPolicy("bridge-held", bridged_hold_s=start_hold_s)
BRIDGE_AT_ONCE = StartPolicy("bridge-at-once", bridged_hold_s=start_hold_s, held=False)
# By name, the gateway's first (`decoder_schedule --starts`).
START_POLICIES = {policy.name: policy for policy in (EXACT_OR_BRIDGE, BRIDGE_HELD, BRIDGE_AT_ONCE)}
