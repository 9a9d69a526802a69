"""WebRTC sessions: the session protocol (typed messages and their JSON Schema), one aiortc peer per browser
with its utterance queue, its synthesis worker and its playout reporting, the set of sessions, and ICE settings.

Owns: `protocol`, `Session`, `Speaker`, `PlayoutReporter`, `SessionManager`, `SessionServices`, `ice`.
May import: `gateway.speech` (the synthesizer), `gateway.media` (playout, Opus), `gateway.service` (admission,
metrics), `gateway.config`, `gateway.orpheus`, aiortc. Not the HTTP edge: signalling routes live in
`gateway.edge.signalling` and hand sessions what they need.
"""
