"""The four scenarios of the seed benchmark: what each user speaks at each point of the sweep."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.benchmarks.corpus import MAX_USERS_PHRASE, Phrase, cycled, mixed, select
from gateway.benchmarks.records import PlannedRequest
from gateway.benchmarks.settings import MAX_USERS, SCENARIOS, STREAMING, STRESS, TTFA, BenchOptions

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
}


def sweep(name: str, options: BenchOptions) -> list[int]:
    """The concurrency (or user count) of each point of a scenario."""
    return {
        STRESS: options.stress_concurrency,
        TTFA: options.ttfa_concurrency,
        MAX_USERS: options.max_users,
        STREAMING: options.streaming_users,
    }[name]


def phrases_for(name: str, users: int, options: BenchOptions) -> list[list[Phrase]]:
    """Each user's phrases at one point."""
    if name in (STRESS, TTFA):
        return [[p] for p in cycled(select("medium"), users)]
    if name == MAX_USERS:
        return [[MAX_USERS_PHRASE] for _ in range(users)]
    if name == STREAMING:
        per_user = options.phrases_per_user
        flat = mixed(users * per_user, options.bench_seed)
        return [flat[u * per_user:(u + 1) * per_user] for u in range(users)]
    raise ValueError(f"unknown scenario {name!r}; choose from {SCENARIOS}")


def workload(name: str, users: int, options: BenchOptions) -> Workload:
    return [[PlannedRequest(user, index, phrase) for index, phrase in enumerate(phrases)]
            for user, phrases in enumerate(phrases_for(name, users, options))]

