"""`orpheus-gateway` command line: serve, synth, bench, make-test-model."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys
import time
import wave
from pathlib import Path

from gateway import config as config_mod
from gateway.orpheus import SAMPLE_RATE

SYNTH_READY_TIMEOUT_S = 30.0  # synth waits this long for a --vllm-url server that is still starting


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def _one_ffmpeg_thread() -> None:
    """FFmpeg in its callers' threads, for a command that runs media (`gateway.media.avthreads`)."""
    from gateway.media.avthreads import use_one_ffmpeg_thread

    use_one_ffmpeg_thread()


def cmd_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from gateway.edge.app import create_app
    from gateway.edge.http import GATEWAY_KEY
    from gateway.speech.checkpoints import require_checkpoints

    config = config_mod.from_sources(args)
    _configure_logging(config.log_level)
    require_checkpoints(config)  # before anything starts: a missing model is one line and exit 2
    if config.workers > 1:
        from gateway.cluster.supervisor import run_supervisor

        return run_supervisor(config)
    _one_ffmpeg_thread()
    app = create_app(config)
    state = app[GATEWAY_KEY]
    # The engine loads after the port is open (health answers at once); if it cannot start, stop: an
    # orchestrator restarts or reports a process that exits, not one that stays "not ready" for ever.
    state.on_failure = lambda _reason: os.kill(os.getpid(), signal.SIGTERM)
    try:
        web.run_app(app, host=config.host, port=config.port, access_log=None)
    except OSError as exc:  # the port is taken, or the address is not this host's
        print(f"orpheus-gateway: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    if state.failure is not None:
        print(f"orpheus-gateway: error: the speech engine cannot start: {state.failure}", file=sys.stderr)
        return 1
    return 0


async def _synth(args: argparse.Namespace) -> int:
    from gateway.speech.synthesizer import Synthesizer, UtteranceStats

    # One text needs no warm-up ladder: its bursts cost minutes on a CPU and memory beside the KV cache.
    config = dataclasses.replace(config_mod.from_sources(args), warmup_batch_sizes=[])
    _configure_logging(config.log_level)
    _one_ffmpeg_thread()
    synthesizer = await asyncio.to_thread(Synthesizer.load, config)
    try:
        await synthesizer.start()
    except BaseException:  # failed or interrupted: what started here is stopped here, then the error is told
        await synthesizer.close()
        raise
    if not synthesizer.engine.ready:  # remote servers (--vllm-url) that do not answer yet
        try:
            await synthesizer.engine.wait_ready(SYNTH_READY_TIMEOUT_S)
        except TimeoutError:
            await synthesizer.close()
            print(f"orpheus-gateway: error: no vLLM server answered within {SYNTH_READY_TIMEOUT_S:.0f} s: "
                  f"{', '.join(config.vllm_urls)}", file=sys.stderr)
            return 1
    stats = UtteranceStats()
    out = Path(args.output)
    try:
        with wave.open(str(out), "wb") as wav:
            wav.setnchannels(1)
            wav.setsampwidth(2)
            wav.setframerate(SAMPLE_RATE)
            t0 = time.monotonic()
            async for chunk in synthesizer.utterance(args.text, args.voice, stats=stats):
                wav.writeframes(chunk.pcm.tobytes())
            elapsed = time.monotonic() - t0
    finally:
        await synthesizer.close()
    ttfa = f"{stats.ttfa_s * 1000:.0f} ms" if stats.ttfa_s is not None else "-"
    print(f"wrote {out}: {stats.audio_s:.2f} s of audio in {elapsed:.2f} s, {stats.sentences} sentence(s), "
          f"{stats.frames} frames, first audio after {ttfa}, {stats.dropped_tokens} tokens dropped")
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    return asyncio.run(_synth(args))


def run_make_test_model(argv: list[str]) -> int:
    from gateway.devtools.devmodels import main as devmodels_main

    return devmodels_main(argv)


def run_bench(argv: list[str]) -> int:
    from gateway.benchmarks.run import main as bench_main

    _one_ffmpeg_thread()
    return bench_main(argv)


# Commands with parsers of their own: everything after the name is theirs, `--help` included.
PASS_THROUGH = {"bench": run_bench, "make-test-model": run_make_test_model}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orpheus-gateway", description="Real-time WebRTC gateway for Orpheus TTS.")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="Run the gateway (HTTP + WebRTC).")
    config_mod.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    synth = sub.add_parser("synth", help="Speak a text into a WAV file.")
    synth.add_argument("text", help="Text to speak.")
    synth.add_argument("-o", "--output", default="out.wav", help="WAV file to write [default: out.wav].")
    synth.add_argument("--voice", dest="voice", default=None, help="Voice [default: the model's first].")
    config_mod.add_arguments(synth)
    synth.set_defaults(func=cmd_synth)

    # Listed for the top-level help; `main` hands their arguments to their own parsers.
    sub.add_parser("bench", help="Benchmarks (gateway/benchmarks/README.md); `bench --help` for its options.",
                   add_help=False)
    sub.add_parser("make-test-model", help="Write a random-weight Orpheus-shaped model (tests, benchmarks); "
                   "`make-test-model --help` for its options.", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in PASS_THROUGH:
        return PASS_THROUGH[argv[0]](argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except config_mod.ConfigError as exc:  # one clear line, not a traceback
        print(f"orpheus-gateway: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
