"""WebRTC sessions: the session protocol (typed messages and their JSON Schema), one aiortc peer per browser
with its utterance queue, its synthesis worker and its playout reporting, the set of sessions, and ICE settings.

Owns: `protocol` and its `errors`, `Session`, `Speaker`, `PlayoutReporter`, `SessionManager`, `SessionServices`,
`ice`, and each session's utterance timelines: `timeline` (word timings and visemes per sentence, heard reports,
rate), `timings` (made off the event loop, one aligner per process), `replay` (recordings and `repeat`), `rtpclock`
(RTP timestamps of the audio track).
May import: `gateway.speech` (the synthesizer), `gateway.media` (playout, Opus, time-stretch), `gateway.service`
(admission, metrics), `gateway.timing` (word timings, visemes), `gateway.config`, `gateway.model_table`,
`gateway.orpheus`, aiortc. Not the HTTP edge: signalling routes live in `gateway.edge.signalling` and hand sessions
what they need.
"""
