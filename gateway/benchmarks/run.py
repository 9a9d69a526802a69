"""Benchmark entry point: `orpheus-gateway bench ...` or `python -m gateway.benchmarks.run ...` (README.md here).

`main(argv)` builds the model and the engine; `run_scenarios(synth, config, options)` runs the scenarios on an
already started `Synthesizer` (the tests share theirs), prints the tables and writes the JSON and the plots.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.benchmarks import engine_level, webrtc_level
from gateway.benchmarks.budget import budgeted, sentence_budgets, unbudgeted_requests
from gateway.benchmarks.client_pool import ClientPool
from gateway.benchmarks.corpus import MAX_USERS_PHRASE, all_texts
from gateway.benchmarks.engine_memory import engine_memory
from gateway.benchmarks.gateway_procs import GatewayWatch
from gateway.benchmarks.machine import machine_info
from gateway.benchmarks.models import bench_models_file, chosen_model, engine_config, model_shape
from gateway.benchmarks.probes import PointProbe
from gateway.benchmarks.records import PlannedRequest, RequestRecord, summarize
from gateway.benchmarks.report import markdown_table, pipeline_table, write_json
from gateway.benchmarks.scenarios import Workload, span_language, sweep, variants, workload
from gateway.benchmarks.settings import (
    BARE,
    ENGINE,
    MIXED_SPANS,
    WEBRTC,
    BenchOptions,
    build_parser,
    options_from_args,
)
from gateway.config import GatewayConfig
from gateway.speech.stream_decoder import StreamDecoder
from gateway.speech.synthesizer import Synthesizer

SCHEMA = "orpheus-gateway-bench/1"
RESULTS_ROOT = Path("bench-results")
BENCH_LOG_LEVEL = "warning"  # the gateway's info logs would bury the tables
PLOTS_MISSING = "[bench] plots skipped: matplotlib is not installed (pip install 'orpheus-gateway[bench]')"

PointRunner = Callable[[Workload, BenchOptions], Awaitable[list[RequestRecord]]]

log = logging.getLogger("bench")


# --- one run on a started synthesizer ----------------------------------------------------------------

async def run_scenarios(synth: Synthesizer, config: GatewayConfig, options: BenchOptions,
                        argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Every scenario at every level; returns the run (also written to `<out>/bench.json`)."""
    out_dir = options.out_dir or RESULTS_ROOT / datetime.now().strftime("%Y%m%d-%H%M%S")
    texts = all_texts(span_language(synth.table) if MIXED_SPANS in options.scenarios else None)
    bench_synth = budgeted(synth, texts, options.tokens_per_char, options.bench_seed)
    run = _new_run(config, options, argv, bench_synth, texts)
    run["models"] = {"served": synth.table.listing(), "memory": engine_memory(synth)}
    await _warm_up(bench_synth, options)
    for level in options.levels:
        async with _point_runner(level, config, bench_synth, options) as (runner, client_pids):
            for scenario in options.scenarios:
                for variant in variants(scenario, options, synth.table):
                    entry: dict[str, Any] = {"scenario": scenario, "variant": variant, "level": level, "points": []}
                    run["scenarios"].append(entry)
                    # The JSON is rewritten after every point: a run cut short keeps what it measured.
                    await _run_scenario(entry, runner, synth, options, out_dir, client_pids,
                                        on_point=lambda: write_json(run, out_dir))
    run["unbudgeted_requests"] = unbudgeted_requests(bench_synth)
    run["finished"] = _now()
    run["json"] = str(write_json(run, out_dir))
    return run


def _new_run(config: GatewayConfig, options: BenchOptions, argv: Sequence[str] | None,
             bench_synth: Synthesizer, texts: Sequence[str]) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "started": _now(),
        "argv": list(argv) if argv is not None else None,
        "machine": machine_info(),
        "model": {"model": config.model, "snac_model": config.snac_model, "shape": model_shape(config.model)},
        "engine": dataclasses.asdict(config),
        "decoder": decoder_in_use(bench_synth),
        "options": dataclasses.asdict(options),
        "budgets": {text: sentence_budgets(bench_synth, text, options.tokens_per_char) for text in texts},
        "scenarios": [],
    }


def decoder_in_use(synth: Synthesizer) -> dict[str, Any] | None:
    """The settings that `engine`'s defaults (None) resolved to in this process's SNAC decoder: its step duty
    (`--snac-step-duty`); None where the decoder is another process's (the shared SNAC process)."""
    decoder = synth.decoder
    return {"step_duty": decoder.timing.step_duty} if isinstance(decoder, StreamDecoder) else None


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


async def _warm_up(synth: Synthesizer, options: BenchOptions) -> None:
    """Unmeasured requests first: first-use allocations and kernel choices must not land in a table."""
    warmup = [[PlannedRequest(0, i, MAX_USERS_PHRASE)] for i in range(options.warmup)]
    if warmup:
        await engine_level.run_point(synth, warmup, options)


@contextlib.asynccontextmanager
async def _point_runner(level: str, config: GatewayConfig, synth: Synthesizer, options: BenchOptions
                        ) -> AsyncIterator[tuple[PointRunner, list[int]]]:
    """How a point runs at this level, and the PIDs of client processes (their CPU is not the gateway's)."""
    if level == BARE:
        yield functools.partial(engine_level.run_point_bare, synth), []
    elif level == ENGINE:
        yield functools.partial(engine_level.run_point, synth), []
    elif level == WEBRTC:
        async with webrtc_level.LocalGateway(config, synth) as gateway:
            if options.client_processes:
                async with ClientPool(options.client_processes) as pool:
                    yield functools.partial(pool.run_point, gateway.base_url), pool.pids
            else:
                yield functools.partial(webrtc_level.run_point, gateway.base_url), []
    else:
        raise ValueError(f"unknown level {level!r}")


async def run_external(options: BenchOptions, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The WebRTC level against `options.gateway_url`, a gateway running in other processes."""
    assert options.gateway_url is not None
    out_dir = options.out_dir or RESULTS_ROOT / datetime.now().strftime("%Y%m%d-%H%M%S")
    run: dict[str, Any] = {"schema": SCHEMA, "started": _now(), "argv": list(argv) if argv is not None else None,
                           "machine": machine_info(), "gateway_url": options.gateway_url,
                           "options": dataclasses.asdict(options), "scenarios": []}
    async with contextlib.AsyncExitStack() as stack:
        if options.client_processes:
            pool = await stack.enter_async_context(ClientPool(options.client_processes))
            runner: PointRunner = functools.partial(pool.run_point, options.gateway_url)
            client_pids = pool.pids
        else:
            runner, client_pids = functools.partial(webrtc_level.run_point, options.gateway_url), []
        for scenario in options.scenarios:
            entry: dict[str, Any] = {"scenario": scenario, "level": WEBRTC, "points": []}
            run["scenarios"].append(entry)
            await _run_scenario(entry, runner, None, options, out_dir, client_pids,
                                on_point=lambda: write_json(run, out_dir))
    run["finished"] = _now()
    run["json"] = str(write_json(run, out_dir))
    return run


async def _run_scenario(entry: dict[str, Any], runner: PointRunner, synth: Synthesizer | None, options: BenchOptions,
                        out_dir: Path, client_pids: Sequence[int], on_point: Callable[[], object]) -> None:
    """Fill `entry` (scenario, variant, level, points) point by point, then print its tables and draw its plot."""
    scenario, level, points = entry["scenario"], entry["level"], entry["points"]
    variant: str | None = entry.get("variant")
    label = scenario if variant is None else f"{scenario} {variant}"
    table = synth.table if synth is not None else None
    for users in sweep(scenario, options):
        started = time.monotonic()
        points.append(await _measure_point(runner, workload(scenario, users, options, variant, table), users, synth,
                                           options, client_pids))
        on_point()
        print(f"[bench] {label} ({level}) {users}: {time.monotonic() - started:.1f} s", file=sys.stderr)
        await asyncio.sleep(options.cooldown_s)
    if options.print_tables:
        print(markdown_table(scenario, level, points, options.buffers_ms, variant) + "\n", flush=True)
        print(pipeline_table(scenario, level, points, variant) + "\n", flush=True)
    if options.plots:
        try:  # matplotlib is optional: the benchmarks' extra
            from gateway.benchmarks.plots import plot_scenario
        except ModuleNotFoundError:
            print(PLOTS_MISSING, file=sys.stderr)
        else:
            name = scenario if variant is None else f"{scenario}-{variant.replace('/', '-')}"
            entry["plot"] = str(plot_scenario(scenario, level, points, options.buffers_ms,
                                              out_dir / f"{name}-{level}.png", variant))


async def _measure_point(runner: PointRunner, planned: Workload, users: int, synth: Synthesizer | None,
                         options: BenchOptions, client_pids: Sequence[int]) -> dict[str, Any]:
    gateway = GatewayWatch(options.gateway_url, options.gateway_pid) if options.gateway_url else None
    probe = PointProbe(synth.decoder if synth is not None else None, client_pids, gateway)
    await probe.start()
    records = await runner(planned, options)
    pipeline = await probe.stop()
    return {"users": users, "summary": summarize(records, users, options.buffers_ms), "pipeline": pipeline,
            "requests": [r.to_dict() for r in records]}


# --- command line ------------------------------------------------------------------------------------

async def _run_cli(config: GatewayConfig, options: BenchOptions, argv: Sequence[str]) -> dict[str, Any]:
    from gateway.edge.state import freeze_startup_objects

    started = time.monotonic()
    synth = await asyncio.to_thread(Synthesizer.load, config)
    try:  # the engine started here is shut down here, however the run ends
        await synth.start()
        print(f"[bench] engine ready after {time.monotonic() - started:.1f} s", file=sys.stderr)
        if config.gc_freeze:
            freeze_startup_objects()  # as `serve` does: no full-GC pauses across all streams
        return await run_scenarios(synth, config, options, argv)
    finally:
        await synth.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.log_level is None:
        args.log_level = BENCH_LOG_LEVEL
    if args.gateway_url:
        options = dataclasses.replace(options_from_args(args, 0.0), levels=[WEBRTC])  # the only level there
        if options.tokens_per_char:
            print("bench: error: --gateway-url runs without token budgets (the gateway's model must stop by "
                  "itself): drop --tokens-per-char", file=sys.stderr)
            return 2
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        run = asyncio.run(run_external(options, argv))
        print(f"[bench] wrote {run['json']}", file=sys.stderr)
        return 0
    with chosen_model(args) as choice, tempfile.TemporaryDirectory(prefix="orpheus-bench-models-") as folder:
        try:
            models_file = bench_models_file(args, choice, engine_config(args, choice).model, Path(folder))
            config = engine_config(args, choice, models_file=models_file)
        except ValueError as exc:  # a bad engine setting: one line, not a traceback
            print(f"bench: error: {exc}", file=sys.stderr)
            return 2
        options = options_from_args(args, choice.tokens_per_char)
        logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        run = asyncio.run(_run_cli(config, options, argv))
    print(f"[bench] wrote {run['json']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
