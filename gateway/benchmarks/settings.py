"""Benchmark options: the command line, the seed's sweeps (GPU defaults) and the `--quick` CPU preset.

Every GatewayConfig field is also a flag here (`--max-num-seqs 128`, `--enforce-eager`, `--kv-cache-dtype
fp8`, `--decode-max-batch 128`, ...), typed like `orpheus-gateway serve`'s; environment variables are not
read, so a run's settings are exactly its command line (and all of them are written into the JSON).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.config import add_arguments

BARE = "vllm"  # the engine alone, no SNAC: the ceiling
ENGINE = "engine"
WEBRTC = "webrtc"
LEVELS = (BARE, ENGINE, WEBRTC)
BOTH = "both"  # engine,webrtc
ALL = "all"

STRESS = "stress"  # the seed's four scenarios (scenarios.py says what each user speaks)
TTFA = "ttfa"
MAX_USERS = "max-users"
STREAMING = "streaming"
SCENARIOS = (STRESS, TTFA, MAX_USERS, STREAMING)
# Several models on one GPU (issue 37; not in `all`): each needs its own table (`--models`, `--lora-voice`).
TRAFFIC = "traffic"  # N streams split between the served models by --traffic shares (one model: all on it)
LORA = "lora"  # N streams on a base voice, then N on a LoRA voice of that base
MIXED_SPANS = "mixed-spans"  # utterances with spans of two languages (two models): underruns at span boundaries
MODEL_SCENARIOS = (TRAFFIC, LORA, MIXED_SPANS)
KNOWN_SCENARIOS = (*SCENARIOS, *MODEL_SCENARIOS)

# The seed's sweeps (its table in docs/benchmarks.md), to compare with it.
GPU_SWEEPS: dict[str, list[int]] = {
    STRESS: [4, 8, 12, 16],
    TTFA: [1, 4, 8, 12, 16],
    MAX_USERS: [32, 64, 128, 200, 256],
    STREAMING: [32, 64, 100, 128, 200, 256],
    TRAFFIC: [128, 256],
    LORA: [128, 256],
    MIXED_SPANS: [1, 64],
}
# Smoke counts for a 2-core CPU and the tiny model.
QUICK_SWEEPS: dict[str, list[int]] = {
    STRESS: [1, 2],
    TTFA: [1, 2],
    MAX_USERS: [4, 8],
    STREAMING: [2, 4],
    TRAFFIC: [2],
    LORA: [2],
    MIXED_SPANS: [1, 2],
}
# --quick also shortens the audio of random-weight models (their length is the budget): ~1.3 s per medium phrase.
QUICK_TOKENS_PER_CHAR = 1.5
DEFAULT_BUFFERS_MS = [0, 500]  # no client buffer, and the seed's recommended 500 ms
DEFAULT_STALL_TOLERANCE_MS = 10.0  # half a 20 ms frame: receive-side scheduling noise, not a stall
DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_COOLDOWN_S = 1.0  # between points: let aborted requests and the SNAC queue drain
DEFAULT_CONNECT_CONCURRENCY = 16
DEFAULT_TRAFFIC = [[50, 50], [80, 20]]  # percent of the streams on each served model, in table order
DEFAULT_LORA_RANK = 32
SWEEP_FLAGS = {STRESS: "stress_concurrency", TTFA: "ttfa_concurrency", MAX_USERS: "max_users",
               STREAMING: "streaming_users", TRAFFIC: "traffic_users", LORA: "lora_users",
               MIXED_SPANS: "mixed_spans_users"}


@dataclass
class BenchOptions:
    scenarios: list[str] = field(default_factory=lambda: list(SCENARIOS))
    levels: list[str] = field(default_factory=lambda: [ENGINE])
    stress_concurrency: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[STRESS]))
    ttfa_concurrency: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[TTFA]))
    max_users: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[MAX_USERS]))
    streaming_users: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[STREAMING]))
    traffic_users: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[TRAFFIC]))
    lora_users: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[LORA]))
    mixed_spans_users: list[int] = field(default_factory=lambda: list(GPU_SWEEPS[MIXED_SPANS]))
    models: int = 1  # models served at once (the CLI's table; run_scenarios takes the synthesizer's)
    traffic: list[list[int]] = field(default_factory=lambda: [list(s) for s in DEFAULT_TRAFFIC])
    lora_voice: str | None = None  # a LoRA adapter voice on the first model ("": a random one built for the run)
    lora_rank: int = DEFAULT_LORA_RANK
    phrases_per_user: int = 1
    buffers_ms: list[int] = field(default_factory=lambda: list(DEFAULT_BUFFERS_MS))
    listener_buffer_ms: int = 0  # what the gateway is told the listener holds (see `--listener-buffer-ms`)
    tokens_per_char: float = 0.0  # 0: the model decides when to stop
    bench_seed: int = 0
    warmup: int = 1
    cooldown_s: float = DEFAULT_COOLDOWN_S
    request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    stall_tolerance_ms: float = DEFAULT_STALL_TOLERANCE_MS
    connect_concurrency: int = DEFAULT_CONNECT_CONCURRENCY
    client_processes: int = 0  # webrtc: 0 = client peers in the benchmark's own event loop
    gateway_url: str | None = None  # webrtc against a gateway running elsewhere (no engine in this process)
    gateway_pid: int | None = None  # that gateway's supervisor, on this host: its processes' CPU per point
    out_dir: Path | None = None  # None: bench-results/<timestamp>/
    plots: bool = True
    keep_arrivals: bool = False
    quick: bool = False
    print_tables: bool = True


def int_list(text: str, minimum: int = 0) -> list[int]:
    """`64,128,256` as an argparse type: comma-separated whole numbers, each >= `minimum`."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < minimum:
        raise argparse.ArgumentTypeError(f"expected integers >= {minimum}, got {text!r}")
    return values


def positive_int_list(text: str) -> list[int]:
    """`1,64`: comma-separated whole numbers, each >= 1 (sizes, utterances at once)."""
    return int_list(text, 1)


_int_list = int_list


def _milliseconds(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _scenario_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == [ALL]:
        return list(SCENARIOS)
    unknown = [n for n in names if n not in KNOWN_SCENARIOS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown scenario(s) {unknown}; choose from {[*KNOWN_SCENARIOS, ALL]}")
    return names


def _traffic_list(text: str) -> list[list[int]]:
    """`50/50,80/20` -> [[50, 50], [80, 20]]: each split's percentages, summing to 100."""
    splits: list[list[int]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            shares = [int(share) for share in part.split("/")]
        except ValueError:
            shares = []
        if len(shares) < 2 or min(shares) < 0 or sum(shares) != 100:
            raise argparse.ArgumentTypeError(f"traffic split {part!r} is not percentages per model summing to 100, "
                                             "e.g. 50/50 or 80/20")
        splits.append(shares)
    if not splits:
        raise argparse.ArgumentTypeError(f"expected traffic splits such as 50/50,80/20, got {text!r}")
    return splits


def _level_list(text: str) -> list[str]:
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == [BOTH]:
        return [ENGINE, WEBRTC]
    unknown = [n for n in names if n not in LEVELS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown level(s) {unknown}; choose from {[*LEVELS, BOTH]}")
    return names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="orpheus-gateway bench",
        description="Orpheus gateway benchmarks: the seed's stress/ttfa/max-users/streaming tables, at the engine "
                    "or the WebRTC level. Definitions: the README.md beside gateway/benchmarks/run.py.")
    _add_bench_arguments(parser.add_argument_group("benchmark"))
    _add_model_arguments(parser.add_argument_group("model"))
    add_arguments(parser.add_argument_group("engine settings (GatewayConfig)"))  # type: ignore[arg-type]
    return parser


def _add_bench_arguments(group: Any) -> None:
    group.add_argument("--scenario", type=_scenario_list, default=list(SCENARIOS),
                       help=f"comma-separated: {', '.join(SCENARIOS)} or {ALL} [default: {ALL}]")
    group.add_argument("--level", type=_level_list, default=[ENGINE], metavar="LEVEL,...",
                       help="comma-separated, run in this order: vllm (the engine alone, no SNAC: the ceiling), "
                            "engine (Synthesizer in-process), webrtc (gateway + headless peers); "
                            "both = engine,webrtc [default: engine]")
    group.add_argument("--quick", action="store_true", help=f"tiny sweeps for a CPU smoke run: {QUICK_SWEEPS}")
    for name in KNOWN_SCENARIOS:
        flag = "--" + SWEEP_FLAGS[name].replace("_", "-")
        group.add_argument(flag, type=_int_list, default=None, metavar="N,N,...",
                           help=f"points of the {name} sweep [default: {_csv(GPU_SWEEPS[name])}; "
                                f"--quick: {_csv(QUICK_SWEEPS[name])}]")
    group.add_argument("--phrases-per-user", type=int, default=1,
                       help="streaming, traffic, lora: phrases each user speaks in turn")
    group.add_argument("--models", type=int, default=1, choices=(1, 2),
                       help="models served at once, each its own engine with an even share of the GPU memory (the "
                            "same checkpoint under a second name, speaking pt-BR: a second language for "
                            f"{MIXED_SPANS}) [default: 1]")
    group.add_argument("--traffic", type=_traffic_list, default=[list(s) for s in DEFAULT_TRAFFIC],
                       metavar="P/P,...", help=f"{TRAFFIC}: the streams' shares per model, one point per split "
                                           "(one model: all on it) [default: 50/50,80/20]")
    group.add_argument("--lora-voice", nargs="?", const="", default=None, metavar="ADAPTER_DIR",
                       help=f"serve a LoRA adapter voice on the first model ({LORA}): a PEFT adapter directory, "
                            "built there if absent; no value: a random adapter (rank --lora-rank, every attention "
                            "and MLP projection) beside a --tiny/--random-orpheus model")
    group.add_argument("--lora-rank", type=int, default=DEFAULT_LORA_RANK,
                       help=f"rank of the random adapter --lora-voice builds [default: {DEFAULT_LORA_RANK}]")
    group.add_argument("--buffers-ms", type=_int_list, default=list(DEFAULT_BUFFERS_MS), metavar="MS,MS,...",
                       help=f"client buffers of the stall check [default: {_csv(DEFAULT_BUFFERS_MS)}]")
    group.add_argument("--listener-buffer-ms", type=_milliseconds, default=0, metavar="MS",
                       help="the buffer the gateway is told its listeners hold: engine level, the decoder's lead "
                            "(it orders streams and bridges by it); webrtc, the peers' jitter_buffer_ms (the "
                            "server's playout holds it). The stall views of --buffers-ms are total buffers, so "
                            "those below it are dropped; 0: the gateway plays at once, the views are client-side "
                            "[default: 0]")
    group.add_argument("--stall-tolerance-ms", type=float, default=DEFAULT_STALL_TOLERANCE_MS,
                       help=f"lateness that is not yet a stall [default: {DEFAULT_STALL_TOLERANCE_MS}]")
    group.add_argument("--tokens-per-char", type=float, default=None,
                       help="audio-token budget per character of each sentence (random-weight models never stop); "
                            "0 = let the model stop [default: 6 with --tiny/--random-orpheus (--quick: "
                            f"{QUICK_TOKENS_PER_CHAR}), else 0]")
    group.add_argument("--bench-seed", type=int, default=0, help="seed of the phrase mix and the sampling seeds")
    group.add_argument("--warmup", type=int, default=1, help="requests spoken before measuring [default: 1]")
    group.add_argument("--cooldown-s", type=float, default=DEFAULT_COOLDOWN_S, help="pause between points")
    group.add_argument("--request-timeout-s", type=float, default=DEFAULT_REQUEST_TIMEOUT_S)
    group.add_argument("--connect-concurrency", type=int, default=DEFAULT_CONNECT_CONCURRENCY,
                       help="webrtc: peers negotiating at once (per client process)")
    group.add_argument("--gateway-url", default=None, metavar="URL",
                       help="webrtc level against a gateway that is already running (e.g. `serve --workers 8`), "
                            "no engine in this process; its model must stop by itself (no token budgets), so "
                            "--tokens-per-char is 0; SNAC's batching comes from its /metrics")
    group.add_argument("--gateway-pid", type=int, default=None, metavar="PID",
                       help="with --gateway-url on this host: the pid of its `serve --workers` supervisor, whose "
                            "processes' CPU (workers, vllm serve, engine core, SNAC process) each point reports")
    group.add_argument("--client-processes", type=int, default=0, metavar="K",
                       help="webrtc: run the client peers in K processes of their own, so they don't share the "
                            "gateway's event loop (use for more than a few dozen peers) [default: 0 = in-process]")
    group.add_argument("--out", type=Path, default=None, help="output folder [default: bench-results/<timestamp>/]")
    group.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    group.add_argument("--keep-arrivals", action="store_true", help="write every chunk/frame arrival into the JSON")


def _add_model_arguments(group: Any) -> None:
    choice = group.add_mutually_exclusive_group()
    choice.add_argument("--tiny", action="store_true",
                        help="build the tiny test model and SNAC in a temp dir (CPU smoke runs)")
    choice.add_argument("--random-orpheus", type=Path, default=None, metavar="DIR",
                        help="build (if missing) and use a random-weight model of Orpheus 3B's exact shape "
                             "(stop probability 0) and a random SNAC under DIR/snac")


def _csv(values: list[int]) -> str:
    return ",".join(str(v) for v in values)


def _tokens_per_char(args: argparse.Namespace, model_default: float) -> float:
    if args.tokens_per_char is not None:
        return args.tokens_per_char
    if args.quick and model_default > 0:
        return min(model_default, QUICK_TOKENS_PER_CHAR)
    return model_default


def _gateway_pid(args: argparse.Namespace) -> int | None:
    if args.gateway_pid is None:
        return None
    import psutil

    if not args.gateway_url:
        raise SystemExit("--gateway-pid needs --gateway-url (the gateway whose processes it names)")
    if not psutil.pid_exists(args.gateway_pid):
        raise SystemExit(f"--gateway-pid {args.gateway_pid}: no such process on this host")
    return int(args.gateway_pid)


def listened_buffers(buffers_ms: list[int], listener_buffer_ms: int) -> list[int]:
    """The stall views a run can show: total listener buffers, so none below the one the gateway holds."""
    kept = [b for b in buffers_ms if b >= listener_buffer_ms]
    if not kept:
        raise SystemExit(f"--buffers-ms {_csv(buffers_ms)}: none is >= --listener-buffer-ms {listener_buffer_ms}, "
                         "so no stall view is left")
    return kept


def _check_model_scenarios(args: argparse.Namespace) -> None:
    """The scenarios of several models need the table they measure (the CLI builds it from these flags)."""
    if args.gateway_url and set(args.scenario) & set(MODEL_SCENARIOS):
        raise SystemExit(f"--gateway-url runs the seed's scenarios only, not {sorted(MODEL_SCENARIOS)}")
    if MIXED_SPANS in args.scenario and args.models < 2:
        raise SystemExit(f"--scenario {MIXED_SPANS} needs --models 2 (a second language's model)")
    if LORA in args.scenario and args.lora_voice is None:
        raise SystemExit(f"--scenario {LORA} needs --lora-voice")
    if args.models > 1 and any(len(split) != args.models for split in args.traffic):
        raise SystemExit(f"--traffic: each split needs one share per model ({args.models}), got "
                         f"{['/'.join(map(str, split)) for split in args.traffic]}")
    if not 1 <= args.lora_rank <= 512:
        raise SystemExit("--lora-rank must be within 1..512")


def options_from_args(args: argparse.Namespace, default_tokens_per_char: float) -> BenchOptions:
    """`default_tokens_per_char`: the model's budget rule (0 for a trained model, which stops by itself)."""
    sweeps = QUICK_SWEEPS if args.quick else GPU_SWEEPS
    chosen = {name: list(getattr(args, attr) if getattr(args, attr) is not None else sweeps[name])
              for name, attr in SWEEP_FLAGS.items()}
    _check_model_scenarios(args)
    return BenchOptions(
        scenarios=args.scenario,
        levels=args.level,
        **{SWEEP_FLAGS[name]: points for name, points in chosen.items()},
        models=args.models,
        traffic=args.traffic,
        lora_voice=args.lora_voice,
        lora_rank=args.lora_rank,
        phrases_per_user=args.phrases_per_user,
        buffers_ms=listened_buffers(args.buffers_ms, args.listener_buffer_ms),
        listener_buffer_ms=args.listener_buffer_ms,
        tokens_per_char=_tokens_per_char(args, default_tokens_per_char),
        bench_seed=args.bench_seed,
        warmup=args.warmup,
        cooldown_s=args.cooldown_s,
        request_timeout_s=args.request_timeout_s,
        stall_tolerance_ms=args.stall_tolerance_ms,
        connect_concurrency=args.connect_concurrency,
        client_processes=max(0, args.client_processes),
        gateway_url=args.gateway_url.rstrip("/") if args.gateway_url else None,
        gateway_pid=_gateway_pid(args),
        out_dir=args.out,
        plots=not args.no_plots,
        keep_arrivals=args.keep_arrivals,
        quick=args.quick,
    )


def parse_options(argv: list[str], default_tokens_per_char: float = 0.0) -> BenchOptions:
    """Options from a command line (tests use this without building a model or a config)."""
    return options_from_args(build_parser().parse_args(argv), default_tokens_per_char)
