"""The fixed benchmark corpus: short, medium and long phrases of a language lesson, in English and Portuguese.

Fixed text keeps runs comparable: the same phrases give the same prompt lengths and, with a token budget per
character (see `gateway.benchmarks.timing.token_budget`), the same audio lengths on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SIZES = ("short", "medium", "long")
LANGUAGES = ("en", "pt")

# Share of each size in the realistic `streaming` mix: mostly short and medium turns, some long explanations.
MIX_WEIGHTS = {"short": 0.4, "medium": 0.4, "long": 0.2}


@dataclass(frozen=True)
class Phrase:
    text: str
    lang: str
    size: str

    @property
    def chars(self) -> int:
        return len(self.text)


_TEXTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("en", "short"): (
        "Good morning, everyone.",
        "Let's start the lesson.",
        "Very good, well done!",
        "Can you repeat that, please?",
        "See you tomorrow.",
        "Listen and repeat.",
    ),
    ("pt", "short"): (
        "Bom dia a todos.",
        "Vamos começar a aula.",
        "Muito bem, parabéns!",
        "Pode repetir, por favor?",
        "Até amanhã.",
        "Ouça e repita.",
    ),
    ("en", "medium"): (
        "Today we are going to practise the past tense with a few simple examples.",
        "Listen carefully and repeat after me: I went to the market yesterday.",
        "That was almost perfect; just pay attention to the final sound of the word.",
        "Open your book on page twelve and read the first paragraph out loud.",
    ),
    ("pt", "medium"): (
        "Hoje vamos praticar o pretérito perfeito com alguns exemplos simples.",
        "Ouça com atenção e repita depois de mim: eu fui ao mercado ontem.",
        "Quase perfeito; só preste atenção no som final da palavra.",
        "Abra o livro na página doze e leia o primeiro parágrafo em voz alta.",
    ),
    ("en", "long"): (
        "In English, the present perfect connects the past with the present, so we say that I have lived here "
        "for five years when we still live here, but that I lived there for five years when it is over.",
        "Before we finish, let's review today's vocabulary. Breakfast, lunch and dinner are the three main "
        "meals, and we usually have breakfast in the morning, lunch at noon and dinner in the evening.",
        "Here is a short story to practise listening: last summer, Maria travelled to the coast with her "
        "family, rented a small house near the beach and spent every afternoon swimming and reading.",
    ),
    ("pt", "long"): (
        "Em português, usamos o pretérito perfeito para ações que terminaram, como em eu morei lá por cinco "
        "anos, e o presente para o que ainda continua, como em eu moro aqui há cinco anos.",
        "Antes de terminar, vamos revisar o vocabulário de hoje. Café da manhã, almoço e jantar são as três "
        "refeições principais, e cada uma tem o seu horário ao longo do dia.",
        "Aqui vai uma pequena história para praticar a escuta: no verão passado, a Maria viajou para o "
        "litoral com a família, alugou uma casa perto da praia e passou as tardes nadando e lendo.",
    ),
}

CORPUS: tuple[Phrase, ...] = tuple(
    Phrase(text, lang, size) for (lang, size), texts in _TEXTS.items() for text in texts)

# `max-users` sends one identical short phrase to everyone, as the seed's limit test did (one sentence).
MAX_USERS_PHRASE = Phrase("Good morning, how are you today?", "en", "short")


def select(size: str | None = None, lang: str | None = None) -> list[Phrase]:
    """Corpus phrases of one size and/or language, languages interleaved (en, pt, en, pt, ...)."""
    chosen = [p for p in CORPUS if (size is None or p.size == size) and (lang is None or p.lang == lang)]
    by_lang = [[p for p in chosen if p.lang == code] for code in LANGUAGES]
    interleaved = [p for group in _zip_longest(by_lang) for p in group]
    return interleaved


def _zip_longest(groups: list[list[Phrase]]) -> list[list[Phrase]]:
    longest = max((len(g) for g in groups), default=0)
    return [[g[i] for g in groups if i < len(g)] for i in range(longest)]


def cycled(phrases: list[Phrase], count: int) -> list[Phrase]:
    """`count` phrases taken round-robin from `phrases`."""
    if not phrases:
        raise ValueError("no phrases to cycle through")
    return [phrases[i % len(phrases)] for i in range(count)]


def mixed(count: int, seed: int) -> list[Phrase]:
    """A reproducible realistic mix: sizes drawn by MIX_WEIGHTS, languages alternating, phrases rotating."""
    rng = random.Random(seed)
    pools = {(size, lang): select(size, lang) for size in SIZES for lang in LANGUAGES}
    next_index = dict.fromkeys(pools, 0)
    out: list[Phrase] = []
    for i in range(count):
        size = rng.choices(list(MIX_WEIGHTS), weights=list(MIX_WEIGHTS.values()))[0]
        key = (size, LANGUAGES[i % len(LANGUAGES)])
        out.append(pools[key][next_index[key] % len(pools[key])])
        next_index[key] += 1
    return out


# `mixed-spans`: an English lesson line quoting the language being learnt, each quote a span of that language
# (`<lang xml:lang="TAG">`, TAG the second model's), so each utterance crosses two span boundaries.
_MIXED_SPAN_TEXTS = (
    'The word for station is <lang xml:lang="{tag}">estação.</lang> Now say it after me, slowly.',
    'Listen to the whole sentence: <lang xml:lang="{tag}">O trem sai da estação às nove horas.</lang> '
    "Did you hear the word for train?",
    'We say good morning as <lang xml:lang="{tag}">bom dia, tudo bem?</lang> and people answer with a smile.',
    'Repeat the question <lang xml:lang="{tag}">Onde fica a biblioteca?</lang> It asks where the library is.',
)
MIXED_SPAN_SIZE = "mixed"


def mixed_span_phrases(tag: str) -> list[Phrase]:
    """The `mixed-spans` phrases, their quotes marked as language `tag` (BCP-47)."""
    return [Phrase(text.format(tag=tag), f"en+{tag}", MIXED_SPAN_SIZE) for text in _MIXED_SPAN_TEXTS]


def all_texts(span_language: str | None = None) -> list[str]:
    """Every text a run can speak (the token budget table is built from these once); with `span_language`, the
    mixed-span phrases too."""
    spans = mixed_span_phrases(span_language) if span_language else []
    return [p.text for p in (*CORPUS, MAX_USERS_PHRASE, *spans)]
