"""Per-sentence token budgets and sampling seeds, applied under the gateway without changing it.

A random-weight model with stop probability 0 never stops by itself: its audio length is whatever
`max_tokens` allows, so a benchmark has to give each sentence a budget proportional to its length (see
`gateway.benchmarks.timing.token_budget`). The WebRTC protocol has no `max_tokens` field, and the synthesizer passes one
value for all sentences of an utterance, so the budget is applied where every request goes through: the
engine's `generate`. `BudgetedEngine` wraps each served model's engine and looks the prompt up in a table
built from the corpus (`build_prompt` of every sentence the run will speak, in every served voice).
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any

from gateway.benchmarks.timing import token_budget
from gateway.model_table import LoraAdapter
from gateway.orpheus import build_prompt
from gateway.speech.synthesizer import Synthesizer
from gateway.speech.utterance_text import VoicedSentence, voiced_sentences


class BudgetedEngine:
    """Forwards everything to the wrapped engine; `generate` gets the sentence's budget and the next seed."""

    def __init__(self, engine: Any, budgets: dict[tuple[int, ...], int], base_seed: int) -> None:
        # object.__setattr__: our own fields; every other attribute write goes to the real engine.
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_budgets", budgets)
        object.__setattr__(self, "_seeds", itertools.count(base_seed))
        object.__setattr__(self, "unbudgeted", 0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        # The gateway sets `engine.on_state`; it must reach the real engine, which calls it.
        setattr(self._engine, name, value)

    async def generate(self, prompt_ids: Sequence[int], *, max_tokens: int | None = None,
                       seed: int | None = None, priority: int = 0,
                       lora: LoraAdapter | None = None) -> AsyncIterator[list[int]]:
        budget = self._budgets.get(tuple(prompt_ids))
        if budget is None and self._budgets:
            object.__setattr__(self, "unbudgeted", self.unbudgeted + 1)
        seed = seed if seed is not None else next(self._seeds)
        async for ids in self._engine.generate(prompt_ids, max_tokens=budget or max_tokens, seed=seed,
                                               priority=priority, lora=lora):
            yield ids


def spoken_sentences(synth: Synthesizer, text: str, voice: str) -> list[tuple[str, str]]:
    """(sentence, voice) of each sentence the synthesizer speaks for `text` in `voice`: split as it splits them,
    each `<lang>` span by its language's voice, empty ones left out as it leaves them out."""
    spoken: list[tuple[str, str]] = []
    for item in voiced_sentences(synth.config, text, voice):
        sentence, sentence_voice = (item.text, item.voice) if isinstance(item, VoicedSentence) else (item, voice)
        if sentence.strip():
            spoken.append((sentence.strip(), sentence_voice))
    return spoken


def prompt_of(synth: Synthesizer, voice: str, sentence: str) -> list[int]:
    """The prompt ids the synthesizer sends for `sentence` in `voice` (its model's tokenizer)."""
    model, _ = synth.table.engine_of(voice)
    return list(build_prompt(synth.tokenizers[model], voice, sentence))


def budget_table(synth: Synthesizer, texts: Iterable[str], voices: Iterable[str], tokens_per_char: float
                 ) -> dict[tuple[int, ...], int]:
    """Prompt ids -> token budget for every sentence of `texts` in each of `voices`, split as the gateway splits
    them."""
    cap = synth.config.max_tokens
    table: dict[tuple[int, ...], int] = {}
    for text in texts:
        for voice in voices:
            for sentence, sentence_voice in spoken_sentences(synth, text, voice):
                budget = token_budget(len(sentence), tokens_per_char, cap)
                if budget is not None:
                    table[tuple(prompt_of(synth, sentence_voice, sentence))] = budget
    return table


def budgeted(synth: Synthesizer, texts: Iterable[str], tokens_per_char: float, base_seed: int) -> Synthesizer:
    """A second `Synthesizer` over the same engines, tokenizers and SNAC decoder, with budgets and seeds."""
    table = budget_table(synth, list(texts), synth.table.voices, tokens_per_char)
    engines = {name: BudgetedEngine(engine, table, base_seed) for name, engine in synth.engines.items()}
    first = engines[next(iter(synth.engines))]
    return Synthesizer(synth.config, first, synth.tokenizer, synth.decoder,  # type: ignore[arg-type]
                       engines=engines, tokenizers=synth.tokenizers)  # type: ignore[arg-type]


def unbudgeted_requests(synth: Synthesizer) -> int:
    """Engine requests of a `budgeted` synthesizer whose prompt had no budget (should be 0)."""
    return sum(engine.unbudgeted for engine in synth.engines.values() if isinstance(engine, BudgetedEngine))


def sentence_budgets(synth: Synthesizer, text: str, tokens_per_char: float) -> list[int | None]:
    """The budget of each sentence of `text` in the default voice (recorded with each request)."""
    cap = synth.config.max_tokens
    return [token_budget(len(s), tokens_per_char, cap) for s, _ in spoken_sentences(synth, text, synth.config.voice)]
