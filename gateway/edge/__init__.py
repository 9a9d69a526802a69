"""The HTTP edge: the aiohttp app and its state, access (bearer and session tokens, origins, CORS), the speech
route, the streaming text-in WebSocket (`cartesia_ws` on the protocol-neutral `text_stream` contexts, word timings
of raw audio streams by `word_times`), WebRTC signalling, health, readiness and metrics.

Owns: `create_app`, `GatewayState`, `AccessPolicy`, the routes, and the exceptions they answer (`errors`).
May import: `gateway.rtc` (sessions and their protocol), `gateway.speech`, `gateway.media`, `gateway.service`,
`gateway.config`, `gateway.orpheus`, aiohttp.
Not `gateway.cluster` (which mounts this app in its workers) nor the command line.
"""
