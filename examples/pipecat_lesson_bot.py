"""A pipecat lesson bot that speaks through the gateway: pipecat's own `CartesiaTTSService`, pointed at the
gateway's streaming door, with the tutor's text streamed in as an LLM writes it and the word frames printed as
karaoke.

The three lines that matter:

    tts = CartesiaTTSService(api_key="<gateway token or anything>", url="ws://localhost:8000/tts/websocket",
                             settings=CartesiaTTSService.Settings(voice="tara"))
    pipeline = Pipeline([transport.input(), stt, user_aggregator, llm, tts, transport.output(), ...])

Here, with no cloud service: the tutor's lines come from stdin (or a built-in lesson), each streamed in word by word
as an LLM would, and the audio goes to a WAV file instead of a transport.

    orpheus-gateway serve --model /tmp/tiny --snac-model /tmp/tiny/snac --enforce-eager   # another shell
    echo "Good morning! Today we learn the days of the week." | python examples/pipecat_lesson_bot.py -o lesson.wav
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import wave

from loguru import logger
from pipecat.frames.frames import (
    EndFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.task import PipelineParams
from pipecat.pipeline.worker import PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.services.cartesia.tts import CartesiaTTSService
from pipecat.workers.runner import WorkerRunner

LESSON = ["Good morning! Today we learn the days of the week.", "Monday comes first, then Tuesday.",
          "Can you say Wednesday?"]
SAMPLE_RATE = 24000


class WavOut(FrameProcessor):
    """Stands in for a transport's output: the bot's audio into a WAV file, its words to the terminal."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.wav = wave.open(path, "wb")
        self.wav.setnchannels(1)
        self.wav.setsampwidth(2)
        self.wav.setframerate(SAMPLE_RATE)
        self.line_done = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if isinstance(frame, TTSAudioRawFrame):
            self.wav.writeframes(frame.audio)
        elif isinstance(frame, TTSTextFrame):
            print(frame.text, end=" ", flush=True)  # each word as its audio plays (pts: when, in ns)
        elif isinstance(frame, TTSStoppedFrame):
            print()
            self.line_done.set()
        await self.push_frame(frame, direction)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gateway", default="http://localhost:8000", help="the gateway's base URL")
    parser.add_argument("--token", default="none", help="the gateway's bearer token, if it asks for one")
    parser.add_argument("--voice", default="tara")
    parser.add_argument("-o", "--out", default="lesson.wav")
    parser.add_argument("--interrupt-after", type=float, default=0.0,
                        help="interrupt the last line this many seconds into it, as a student speaking would")
    parser.add_argument("--log-level", default="WARNING", help="pipecat's own log level (it logs at DEBUG)")
    args = parser.parse_args()
    logger.remove()
    logger.add(sys.stderr, level=args.log_level)
    lines = [line.strip() for line in sys.stdin if line.strip()] if not sys.stdin.isatty() else LESSON

    tts = CartesiaTTSService(api_key=args.token, url=args.gateway.replace("http", "ws", 1) + "/tts/websocket",
                             settings=CartesiaTTSService.Settings(voice=args.voice), sample_rate=SAMPLE_RATE,
                             stop_frame_timeout_s=30.0)  # a CPU gateway can be slow to its first audio
    out = WavOut(args.out)
    worker = PipelineWorker(Pipeline([tts, out]), params=PipelineParams(audio_out_sample_rate=SAMPLE_RATE),
                            enable_rtvi=False)
    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    for number, line in enumerate(lines):
        out.line_done.clear()
        # What an LLM service pushes: its reply, a few characters at a time.
        tokens = [word + " " for word in line.split()]
        await worker.queue_frames([LLMFullResponseStartFrame(), *(LLMTextFrame(t) for t in tokens),
                                   LLMFullResponseEndFrame()])
        if args.interrupt_after and number == len(lines) - 1:
            await asyncio.sleep(args.interrupt_after)
            await worker.queue_frame(InterruptionFrame())  # the gateway cancels the line and its engine request
            print("\n[interrupted]")
            break
        await asyncio.wait_for(out.line_done.wait(), 120)
    await worker.queue_frame(EndFrame())
    await running
    out.wav.close()
    print(f"audio: {args.out}")


if __name__ == "__main__":
    asyncio.run(main())
