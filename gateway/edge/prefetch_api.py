"""`POST /v1/audio/prefetch`: the `prefetch` message over HTTP. `{texts, voice?, language?}` (the message's fields;
`voice` and `language` route as the speech route's do, aliases included) answers at once with the `prefetched`
event's fields: `ready` (the phrase cache holds them: a speech request or `speak` of them makes no engine request),
`pending` (made while the engine has room; ask again), `skipped` (the phrase cache is off). Errors in OpenAI's
shape, as the speech route's."""

from __future__ import annotations

import msgspec
from aiohttp import web

from gateway.edge.http import GATEWAY_KEY
from gateway.edge.speech_api import openai_error, ready_body
from gateway.rtc import protocol
from gateway.speech.errors import InvalidRequestError

PREFETCH_PATH = "/v1/audio/prefetch"


async def prefetch(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY_KEY]
    ready = await ready_body(request)
    if isinstance(ready, web.Response):
        return ready
    body, synthesizer = ready
    try:
        message = msgspec.convert({**body, "type": "prefetch"}, protocol.Prefetch)
        voice = synthesizer.resolve_voice(message.voice, message.language)
        for text in message.texts:
            synthesizer.check_text(text)
    except msgspec.ValidationError as exc:
        return openai_error(400, "invalid_prefetch", str(exc))
    except InvalidRequestError as exc:
        return openai_error(400, exc.code, str(exc))
    phrases = gateway.phrases
    if phrases is None:
        return web.json_response(protocol.to_dict(protocol.Prefetched(ready=[], pending=[], skipped=message.texts)))
    ready = await phrases.prefetch(synthesizer, message.texts, voice)
    marked = list(zip(message.texts, ready, strict=True))
    event = protocol.Prefetched(ready=[t for t, r in marked if r], pending=[t for t, r in marked if not r], skipped=[])
    return web.json_response(protocol.to_dict(event))
