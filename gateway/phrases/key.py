"""What a cached sentence is keyed by: everything that changes its sound, as one digest."""

from __future__ import annotations

import hashlib
import json
import unicodedata
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path

from gateway.config import GatewayConfig

KEY_VERSION = 2  # bumped when the entry format or what goes into a key changes: older entries are never read
STORED_RATE = 1.0  # entries hold audio as synthesised; `rate` is applied on playback, as for a fresh utterance
# A checkpoint's config files; adapter_config.json is a LoRA adapter's (its rank, alpha and target modules).
CONFIG_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "adapter_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def normalise_text(text: str) -> str:
    """One spelling of a sentence: Unicode NFC, whitespace collapsed to single spaces, stripped. Case and
    punctuation stay: they change the prosody."""
    return " ".join(unicodedata.normalize("NFC", text).split())


@lru_cache(maxsize=16)
def checkpoint_identity(path_or_id: str) -> str:
    """A checkpoint's (or a LoRA adapter's) name with a digest of its config files and of its weight files' names
    and sizes (a retrained checkpoint at the same path is another checkpoint). A hub id that is not a folder here is
    named alone."""
    folder = Path(path_or_id)
    if not folder.is_dir():
        return path_or_id
    digest = hashlib.sha256()
    for name in CONFIG_FILES:
        file = folder / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes())
    for file in sorted(folder.rglob("*")):
        if file.suffix in WEIGHT_SUFFIXES and file.is_file():
            digest.update(f"{file.relative_to(folder)}:{file.stat().st_size}".encode())
    return f"{folder.resolve()}@{digest.hexdigest()[:16]}"


@dataclass(frozen=True)
class PhraseKey:
    """One sentence as the engine would say it."""

    model: str
    adapter: str  # the LoRA adapter the voice runs with on `model` (its `checkpoint_identity`); "" for none
    codec: str
    voice: str
    language: str  # of the stored word timings and visemes
    text: str
    temperature: float
    top_p: float
    repetition_penalty: float
    max_tokens: int
    max_tokens_per_char: float
    rate: float
    seed_policy: str  # "random" (each generation is a sample; the cache keeps the first) or "seed:<n>"

    @classmethod
    def of(cls, config: GatewayConfig, voice: str, language: str, text: str,
           seed: int | None = None) -> PhraseKey:
        seed = config.seed if seed is None else seed
        table = config.model_table
        adapter = ""
        if voice in table.model_of_voice:  # the checkpoint and sampling of the engine that speaks the voice
            base, lora = table.engine_of(voice)
            config = config.for_model(base)
            adapter = "" if lora is None else checkpoint_identity(lora.path)
        return cls(model=checkpoint_identity(config.model), adapter=adapter,
                   codec=checkpoint_identity(config.snac_model),
                   voice=voice, language=language, text=normalise_text(text), temperature=config.temperature,
                   top_p=config.top_p,
                   repetition_penalty=config.repetition_penalty, max_tokens=config.max_tokens,
                   max_tokens_per_char=config.max_tokens_per_char, rate=STORED_RATE,
                   seed_policy="random" if seed is None else f"seed:{seed}")

    @property
    def digest(self) -> str:
        """The store's key: a hex SHA-256 of every field (and `KEY_VERSION`)."""
        fields = json.dumps({"v": KEY_VERSION, **asdict(self)}, sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(fields.encode()).hexdigest()
