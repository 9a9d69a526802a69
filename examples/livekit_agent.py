"""A LiveKit agent whose voice is the gateway: LiveKit's own Cartesia plugin, pointed at the gateway's streaming
door, with word timestamps (LiveKit's aligned transcript) on.

The three lines that matter, in an agent's entrypoint:

    tts = cartesia.TTS(api_key="<gateway token or anything>", base_url="http://localhost:8000", voice="tara")
    session = AgentSession(stt=..., llm=..., tts=tts, use_tts_aligned_transcript=True)
    await session.start(agent=Tutor(), room=ctx.room)

The gateway is `GATEWAY_URL` (default http://localhost:8000), its token `GATEWAY_TOKEN`.
`python examples/livekit_agent.py dev` runs that entrypoint against a LiveKit server (LIVEKIT_URL, ...), as any
LiveKit agent. With no LiveKit server and no cloud STT/LLM, `offline` drives the same TTS object the way an
AgentSession does (one stream per reply, text pushed as the LLM writes it, `aclose()` when the user barges in):
the tutor's lines come from stdin (or a built-in lesson), the audio goes to a WAV file, the timed words to the terminal.

    orpheus-gateway serve --model /tmp/tiny --snac-model /tmp/tiny/snac --enforce-eager   # another shell
    echo "Good morning! Today we learn the days of the week." | python examples/livekit_agent.py offline -o a.wav
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import wave

from livekit.agents import APIConnectOptions, utils
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT
from livekit.plugins import cartesia

GATEWAY = os.environ.get("GATEWAY_URL", "http://localhost:8000")
TOKEN = os.environ.get("GATEWAY_TOKEN", "none")
LESSON = ["Good morning! Today we learn the days of the week.", "Monday comes first, then Tuesday.",
          "Can you say Wednesday?"]
SAMPLE_RATE = 24000


def gateway_tts(voice: str = "tara") -> cartesia.TTS:
    return cartesia.TTS(api_key=TOKEN, base_url=GATEWAY, voice=voice, sample_rate=SAMPLE_RATE)


async def entrypoint(ctx) -> None:  # type: ignore[no-untyped-def]
    """A LiveKit worker's entrypoint: a tutor in the room, speaking with the gateway's voice."""
    from livekit.agents import Agent, AgentSession
    from livekit.plugins import openai

    session = AgentSession(stt=openai.STT(), llm=openai.LLM(model="gpt-4o-mini"), tts=gateway_tts(),
                           use_tts_aligned_transcript=True)
    await session.start(agent=Agent(instructions="You are a patient language tutor. Keep replies short."),
                        room=ctx.room)
    await session.say(LESSON[0])


async def offline(lines: list[str], out_path: str, voice: str, interrupt_after: float) -> None:
    async with utils.http_context.open():
        tts = gateway_tts(voice)
        options = APIConnectOptions(timeout=60)
        with wave.open(out_path, "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(SAMPLE_RATE)
            for number, line in enumerate(lines):
                stream = tts.stream(conn_options=options)  # one reply
                for word in line.split():  # as the LLM writes it
                    stream.push_text(word + " ")
                stream.end_input()
                started = asyncio.get_running_loop().time()
                async for event in stream:
                    wav.writeframes(event.frame.data.tobytes())
                    for word in event.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, []):
                        print(f"{word.start_time:6.2f}s {word.strip()}")
                    late = asyncio.get_running_loop().time() - started
                    if interrupt_after and number == len(lines) - 1 and late > interrupt_after:
                        print("[interrupted]")  # what AgentSession does when the user barges in
                        break
                await stream.aclose()
        await tts.aclose()  # closes the plugin's socket: an interrupted reply is cancelled on the gateway
    print(f"audio: {out_path}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "offline":
        parser = argparse.ArgumentParser(description="the tutor's lines through the gateway, no LiveKit server")
        parser.add_argument("offline")
        parser.add_argument("--voice", default="tara")
        parser.add_argument("-o", "--out", default="agent.wav")
        parser.add_argument("--interrupt-after", type=float, default=0.0)
        args = parser.parse_args()
        lines = [line.strip() for line in sys.stdin if line.strip()] if not sys.stdin.isatty() else LESSON
        asyncio.run(offline(lines, args.out, args.voice, args.interrupt_after))
        return
    from livekit.agents import WorkerOptions, cli

    cli.run_app(WorkerOptions(entrypoint_fnc=entrypoint))


if __name__ == "__main__":
    main()
