"""What each user speaks at each point of a sweep: the seed benchmark's four scenarios, and the several-models ones
(`traffic`, `lora`, `mixed-spans`), whose voices come from the served model table."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.benchmarks.corpus import MAX_USERS_PHRASE, Phrase, cycled, mixed, mixed_span_phrases, select
from gateway.benchmarks.records import PlannedRequest
from gateway.benchmarks.settings import (
    KNOWN_SCENARIOS,
    LORA,
    MAX_USERS,
    MIXED_SPANS,
    STREAMING,
    STRESS,
    SWEEP_FLAGS,
    TRAFFIC,
    TTFA,
    BenchOptions,
)
from gateway.model_table import ModelTable

Workload = list[list[PlannedRequest]]  # one list of requests per user, spoken in order


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str  # what the seed's table was about
    axis: str  # what the sweep varies, for tables and plots


SCENARIO_INFO = {
    STRESS: Scenario(STRESS, "Stress: N simultaneous requests, one medium phrase each", "N"),
    TTFA: Scenario(TTFA, "Latency: time to first token, frame and audio with N simultaneous requests", "N"),
    MAX_USERS: Scenario(MAX_USERS, "Limit: N users, one identical short phrase each", "users"),
    STREAMING: Scenario(STREAMING, "Realistic streaming: N users, mixed short/medium/long EN+PT phrases", "users"),
    TRAFFIC: Scenario(TRAFFIC, "Several models: N streams (medium phrases) split between the models", "N"),
    LORA: Scenario(LORA, "LoRA voice: N streams (medium phrases) on the base voice, then N on its adapter's", "N"),
    MIXED_SPANS: Scenario(MIXED_SPANS, "Mixed-language utterances: N users, each line quoting a second language's "
                                       "span (its own model); underruns at the span boundaries", "users"),
}
ALONE = "alone"  # `traffic` with one model: the whole load on it
BASE, ADAPTER = "base", "lora"  # the two points of `lora`


def sweep(name: str, options: BenchOptions) -> list[int]:
    """The concurrency (or user count) of each point of a scenario."""
    if name not in SWEEP_FLAGS:
        raise ValueError(f"unknown scenario {name!r}; choose from {KNOWN_SCENARIOS}")
    points: list[int] = getattr(options, SWEEP_FLAGS[name])
    return points


def variants(name: str, options: BenchOptions, table: ModelTable | None) -> list[str | None]:
    """The runs of one scenario (each its own sweep and table): `traffic`, one per split (`80/20`; one model:
    `alone`); `lora`, the base voice and the adapter's; every other scenario, one (None)."""
    if name == TRAFFIC:
        bases = len(_table(name, table).bases)
        if bases == 1:
            return [ALONE]
        wrong = [split for split in options.traffic if len(split) != bases]
        if wrong:
            raise ValueError(f"{TRAFFIC}: each --traffic split needs one share per model ({bases}), got {wrong}")
        return ["/".join(str(share) for share in split) for split in options.traffic]
    if name == LORA:
        return [BASE, ADAPTER]
    return [None]


def _table(name: str, table: ModelTable | None) -> ModelTable:
    if table is None:
        raise ValueError(f"scenario {name!r} needs the engine's model table (the engine level in this process)")
    return table


def traffic_voices(table: ModelTable, split: str, users: int) -> list[str]:
    """Each user's voice: a base model's default voice, `split`'s shares of the users per model (largest
    remainder), interleaved so the burst reaches every engine from its start."""
    defaults = [spec.default_voice for spec in table.bases.values()]
    shares = [1.0] if split == ALONE else [int(share) / 100 for share in split.split("/")]
    exact = [share * users for share in shares]
    counts = [int(x) for x in exact]
    for k in sorted(range(len(exact)), key=lambda k: counts[k] - exact[k])[:users - sum(counts)]:
        counts[k] += 1
    given = [0] * len(counts)
    voices: list[str] = []
    for _ in range(users):  # the model furthest behind its share speaks next
        k = min((k for k in range(len(counts)) if given[k] < counts[k]), key=lambda k: given[k] / counts[k])
        given[k] += 1
        voices.append(defaults[k])
    return voices


def lora_voices(table: ModelTable) -> tuple[str, str]:
    """(a base voice, a LoRA adapter voice on that base): the first adapter's base's default voice and its own."""
    adapters = [spec for spec in table.models.values() if spec.lora_of is not None]
    if not adapters:
        raise ValueError(f"scenario {LORA!r} needs a LoRA voice (--lora-voice); served: {table.describe()}")
    return table.models[adapters[0].lora_of or ""].default_voice, adapters[0].default_voice


def span_language(table: ModelTable) -> str:
    """The language the mixed-span phrases quote: the first one the first model does not serve."""
    first, *others = table.bases.values()
    for spec in others:
        for tag in spec.languages:
            if not first.serves_language(tag):
                return tag
    raise ValueError(f"scenario {MIXED_SPANS!r} needs a second model speaking another language (--models 2); "
                     f"served: {table.describe()}")


def phrases_for(name: str, users: int, options: BenchOptions, table: ModelTable | None = None
                ) -> list[list[Phrase]]:
    """Each user's phrases at one point."""
    if name in (STRESS, TTFA):
        return [[p] for p in cycled(select("medium"), users)]
    if name == MAX_USERS:
        return [[MAX_USERS_PHRASE] for _ in range(users)]
    per_user = options.phrases_per_user
    if name == STREAMING:
        flat = mixed(users * per_user, options.bench_seed)
    elif name in (TRAFFIC, LORA):
        flat = cycled(select("medium"), users * per_user)
    elif name == MIXED_SPANS:
        flat = cycled(mixed_span_phrases(span_language(_table(name, table))), users * per_user)
    else:
        raise ValueError(f"unknown scenario {name!r}; choose from {KNOWN_SCENARIOS}")
    return [flat[u * per_user:(u + 1) * per_user] for u in range(users)]


def user_voices(name: str, variant: str | None, users: int, table: ModelTable | None) -> list[str | None]:
    """Each user's voice (None: the gateway's default)."""
    if name == TRAFFIC:
        return list(traffic_voices(_table(name, table), variant or ALONE, users))
    if name == LORA:
        base, adapter = lora_voices(_table(name, table))
        return [adapter if variant == ADAPTER else base] * users
    if name == MIXED_SPANS:
        return [next(iter(_table(name, table).bases.values())).default_voice] * users
    return [None] * users


def workload(name: str, users: int, options: BenchOptions, variant: str | None = None,
             table: ModelTable | None = None) -> Workload:
    voices = user_voices(name, variant, users, table)
    return [[PlannedRequest(user, index, phrase, voices[user]) for index, phrase in enumerate(phrases)]
            for user, phrases in enumerate(phrases_for(name, users, options, table))]
