"""The table of Orpheus checkpoints one gateway serves: each model's name, weights, voices, languages, sampling and
memory share, and the routing of a request's `voice` and/or `language` to one model and voice.

Built from `--model` (a plain `PATH` is today's one model; `NAME=PATH`, repeatable, one entry each) and
`--models-file` (TOML or JSON with the per-model details); `gateway.config` owns the flags and calls `build_table`.
Voice names are unique across the table (a qualified `model/voice` is accepted too), so a voice names its model.
Languages are BCP-47 tags (`en-US`, `pt-BR`); `espeak_language` maps one to the espeak-ng name that word timings
and visemes use. Imports only `gateway.orpheus`.
"""

from __future__ import annotations

import json
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.orpheus import language_for_voice, voices_for_model

DEFAULT_MODEL_NAME = "default"  # the one model of `--model PATH`
QUALIFIER = "/"  # `pt/ana`: voice `ana` of model `pt`
MODEL_FIELDS = ("path", "voices", "languages", "default_voice", "gpu_memory_utilization", "kv_cache_memory_gib",
                "temperature", "top_p", "repetition_penalty", "vllm_urls", "vllm_model", "max_streams")
LORA_FIELDS = ("path", "base", "voices", "languages", "default_voice")
# vLLM's accepted max_lora_rank values; an engine takes the smallest that holds its adapters' ranks.
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
DEFAULT_LORA_RANK = 16  # an adapter whose adapter_config.json cannot be read here (an HF id): vLLM's default
# espeak-ng names that are not the lower-cased BCP-47 tag (and the way back, for a voice's known language).
_ESPEAK_OF_TAG = {"zh": "cmn", "zh-cn": "cmn", "en": "en-us", "fr": "fr-fr"}
_TAG_OF_ESPEAK = {"cmn": "zh", "en-us": "en-US", "en-gb": "en-GB", "fr-fr": "fr-FR", "pt-br": "pt-BR"}


class ModelTableError(ValueError):
    """A table that cannot work (start-up), or a request naming what the table does not serve (`code` says
    which: `unknown_voice`, `unknown_language`, `voice_language_mismatch`)."""

    def __init__(self, message: str, code: str = "invalid_models") -> None:
        super().__init__(message)
        self.code = code


def espeak_language(tag: str) -> str:
    """The espeak-ng name of a BCP-47 tag: `pt-BR` -> `pt-br`, `en` -> `en-us`, `zh` -> `cmn`."""
    low = tag.strip().lower().replace("_", "-")
    return _ESPEAK_OF_TAG.get(low, low)


def bcp47_of_espeak(name: str) -> str:
    """The BCP-47 tag of an espeak-ng name (`en-us` -> `en-US`), for the languages a model's voices imply."""
    return _TAG_OF_ESPEAK.get(name, name)


def check_tag(tag: object, what: str) -> str:
    """A BCP-47 tag as the table takes it: letters, digits and hyphens, 2-35 characters, a language subtag first."""
    if not isinstance(tag, str) or not 2 <= len(tag) <= 35 or not all(p.isalnum() and p.isascii()
                                                                      for p in tag.split("-")) \
            or not tag.split("-")[0].isalpha():
        raise ModelTableError(f"{what}: {tag!r} is not a BCP-47 language tag such as en-US or pt-BR")
    return tag


@dataclass(frozen=True)
class ModelSpec:
    """One served checkpoint. Unset memory and sampling fields take the gateway's own settings."""

    name: str
    path: str
    voices: tuple[str, ...]
    languages: tuple[str, ...]  # BCP-47, the first is its main one
    default_voice: str
    gpu_memory_utilization: float | None = None
    kv_cache_memory_gib: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    vllm_urls: tuple[str, ...] = ()
    vllm_model: str | None = None
    max_streams: int | None = None  # its utterances at once (its LoRA voices' too); None: an even share of the total
    voice_languages: Mapping[str, str] = field(default_factory=dict)  # voice -> BCP-47
    lora_of: str | None = None  # a LoRA adapter (`path`) of this base model, run on the base's engine

    def language_of(self, voice: str) -> str:
        return self.voice_languages.get(voice, self.languages[0])

    def serves_language(self, tag: str) -> bool:
        return _match_language(tag, self.languages) is not None


def _match_language(tag: str, languages: Sequence[str]) -> str | None:
    """The served tag `tag` asks for: the same tag (any case), else the first of the same primary language."""
    low = tag.lower()
    for served in languages:
        if served.lower() == low:
            return served
    primary = low.split("-")[0]
    for served in languages:
        if served.lower().split("-")[0] == primary:
            return served
    return None


@dataclass(frozen=True)
class LoraAdapter:
    """A LoRA adapter as an engine request names it (vLLM's `LoRARequest`: name, a positive id, the path)."""

    name: str
    id: int
    path: str


def lora_rank(path: str) -> int:
    """The rank `r` of a local PEFT adapter (its adapter_config.json); DEFAULT_LORA_RANK where it cannot be read."""
    try:
        rank = json.loads((Path(path) / "adapter_config.json").read_text()).get("r")
    except (OSError, ValueError):
        return DEFAULT_LORA_RANK
    return rank if isinstance(rank, int) and rank > 0 else DEFAULT_LORA_RANK


def vllm_lora_rank(ranks: Sequence[int]) -> int:
    """The smallest max_lora_rank vLLM accepts that holds every rank."""
    need = max(ranks, default=DEFAULT_LORA_RANK)
    return next((r for r in VLLM_LORA_RANKS if r >= need), VLLM_LORA_RANKS[-1])


def make_lora_spec(name: str, values: Mapping[str, Any], base: ModelSpec) -> ModelSpec:
    """An adapter's entry (`path` required; voices default to its name; languages to its base's), checked."""
    unknown = sorted(set(values) - set(LORA_FIELDS))
    if unknown:
        raise ModelTableError(f"lora {name!r}: unknown field(s) {unknown}; known: {list(LORA_FIELDS)}")
    fields = {key: values[key] for key in ("path", "voices", "languages", "default_voice") if key in values}
    fields.setdefault("voices", [name])
    fields.setdefault("languages", list(base.languages))
    spec = make_spec(name, fields, what="lora")
    return ModelSpec(name=name, path=spec.path, voices=spec.voices, languages=spec.languages,
                     default_voice=spec.default_voice, voice_languages=spec.voice_languages, lora_of=base.name)


def make_spec(name: str, values: Mapping[str, Any], what: str = "model") -> ModelSpec:
    """A model from its table entry (`path` required; the rest optional), checked."""
    unknown = sorted(set(values) - set(MODEL_FIELDS))
    if unknown:
        raise ModelTableError(f"{what} {name!r}: unknown field(s) {unknown}; known: {list(MODEL_FIELDS)}")
    path = values.get("path")
    if not isinstance(path, str) or not path.strip():
        raise ModelTableError(f"{what} {name!r}: 'path' (an HF id or a local path) is required")
    voices = _strings(values.get("voices"), f"{what} {name!r}: voices") or voices_for_model(path)
    if len(set(voices)) != len(voices):
        raise ModelTableError(f"model {name!r}: a voice is listed twice: {voices}")
    for voice in voices:
        if not voice or QUALIFIER in voice or "=" in voice or voice != voice.strip():
            raise ModelTableError(f"model {name!r}: {voice!r} is not a voice name (no '/', '=' or spaces around)")
    declared = [check_tag(t, f"model {name!r}: languages")
                for t in _strings(values.get("languages"), f"model {name!r}: languages")]
    known = {voice: bcp47_of_espeak(language_for_voice(voice)) for voice in voices}
    languages = declared or list(dict.fromkeys(known.values()))
    # A voice speaks its known language where the model serves it, else the model's main language.
    voice_languages = {voice: _match_language(known[voice], languages) or languages[0] for voice in voices}
    default_voice = values.get("default_voice") or voices[0]
    if default_voice not in voices:
        raise ModelTableError(f"model {name!r}: default_voice {default_voice!r} is not among its voices {voices}")
    numbers: dict[str, float | None] = {}
    for key in ("gpu_memory_utilization", "kv_cache_memory_gib", "temperature", "top_p", "repetition_penalty"):
        value = values.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ModelTableError(f"model {name!r}: {key} must be a number")
        numbers[key] = None if value is None else float(value)
    share = numbers["gpu_memory_utilization"]
    if share is not None and not 0 < share <= 1:
        raise ModelTableError(f"model {name!r}: gpu_memory_utilization must be within (0, 1]")
    if numbers["kv_cache_memory_gib"] is not None and numbers["kv_cache_memory_gib"] <= 0:
        raise ModelTableError(f"model {name!r}: kv_cache_memory_gib must be > 0")
    vllm_model = values.get("vllm_model")
    if vllm_model is not None and not isinstance(vllm_model, str):
        raise ModelTableError(f"model {name!r}: vllm_model must be a string")
    max_streams = values.get("max_streams")
    if max_streams is not None and (isinstance(max_streams, bool) or not isinstance(max_streams, int)
                                    or max_streams < 1):
        raise ModelTableError(f"model {name!r}: max_streams must be a whole number >= 1")
    return ModelSpec(name=name, path=path.strip(), voices=tuple(voices), languages=tuple(languages),
                     default_voice=default_voice, vllm_urls=tuple(_strings(values.get("vllm_urls"),
                                                                           f"model {name!r}: vllm_urls")),
                     vllm_model=vllm_model, max_streams=max_streams, voice_languages=voice_languages, **numbers)


def _strings(value: object, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelTableError(f"{what} must be a string or a list of strings")
    return list(value)


def parse_model_flag(item: str, flag: str = "--model") -> tuple[str, str]:
    """`NAME=PATH_OR_HF_ID` -> (name, path); ModelTableError for any other form."""
    name, sep, path = item.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path or QUALIFIER in name:
        raise ModelTableError(f"{flag} {item!r} is not NAME=PATH_OR_HF_ID, e.g. pt=/models/orpheus-pt")
    return name, path


def read_models_file(path: str) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(models, loras), each `{name: {path, voices, ...}}`, from a TOML (`[models.NAME]`, `[loras.NAME]` tables) or
    JSON (`{"models": {NAME: {...}}, "loras": {...}}`) file."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ModelTableError(f"models_file {path!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if file.suffix.lower() == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        kind = "JSON" if file.suffix.lower() == ".json" else "TOML"
        raise ModelTableError(f"models_file {path!r}: not valid {kind}: {exc}") from None
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, dict) or not models or not all(isinstance(v, dict) for v in models.values()):
        raise ModelTableError(f"models_file {path!r}: needs a non-empty 'models' table of NAME -> {{path, voices, "
                              "languages, ...}}")
    loras = data.get("loras", {})
    if not isinstance(loras, dict) or not all(isinstance(v, dict) for v in loras.values()):
        raise ModelTableError(f"models_file {path!r}: 'loras' must be a table of NAME -> {{path, base, voices}}")
    unknown = sorted(set(data) - {"models", "loras"})
    if unknown:
        raise ModelTableError(f"models_file {path!r}: unknown section(s) {unknown}; known: models, loras")
    return models, loras


class ModelTable:
    """The models served, in order (the first is the default's), and the routing of voices and languages."""

    def __init__(self, models: Sequence[ModelSpec]) -> None:
        if not models:
            raise ModelTableError("no model to serve")
        self.models: dict[str, ModelSpec] = {}
        self.model_of_voice: dict[str, ModelSpec] = {}
        for spec in models:
            if spec.name in self.models:
                raise ModelTableError(f"model {spec.name!r} is named twice")
            self.models[spec.name] = spec
            for voice in spec.voices:
                other = self.model_of_voice.get(voice)
                if other is not None:
                    raise ModelTableError(f"voice {voice!r} is served by models {other.name!r} and {spec.name!r}: "
                                          "voice names must be unique across the table (list other voices in the "
                                          "models file)")
                self.model_of_voice[voice] = spec

    @property
    def several(self) -> bool:
        """More than one entry (models or LoRA adapters): per-model settings, metrics and routing apply."""
        return len(self.models) > 1

    @property
    def bases(self) -> dict[str, ModelSpec]:
        """The models that get an engine of their own (not LoRA adapters)."""
        return {name: spec for name, spec in self.models.items() if spec.lora_of is None}

    def adapters_of(self, base: str) -> list[ModelSpec]:
        return [spec for spec in self.models.values() if spec.lora_of == base]

    def engine_of(self, voice: str) -> tuple[str, LoraAdapter | None]:
        """The model whose engine speaks a served voice, and the adapter it runs it with (None: the base itself)."""
        spec = self.model_of_voice[voice]
        if spec.lora_of is None:
            return spec.name, None
        index = [s.name for s in self.models.values() if s.lora_of is not None].index(spec.name)
        return spec.lora_of, LoraAdapter(spec.name, index + 1, spec.path)

    @property
    def voices(self) -> list[str]:
        return list(self.model_of_voice)

    @property
    def languages(self) -> list[str]:
        return list(dict.fromkeys(tag for spec in self.models.values() for tag in spec.languages))

    def language_of(self, voice: str) -> str | None:
        """The BCP-47 language a served voice speaks; None for a voice not served."""
        spec = self.model_of_voice.get(voice)
        return None if spec is None else spec.language_of(voice)

    def model_for(self, voice: str) -> ModelSpec:
        return self.model_of_voice[voice]

    def choose(self, voice: str | None, language: str | None, default: str) -> str:
        """The served voice for a request's `voice` (a served name or `model/voice`; aliases are resolved before)
        and/or `language`: a language alone picks its first model's default voice; with both, the voice's model
        must serve the language. Neither: `default`."""
        if voice:
            if voice not in self.model_of_voice and QUALIFIER in voice:
                model, _, bare = voice.partition(QUALIFIER)
                spec = self.models.get(model)
                if spec is None or bare not in spec.voices:
                    raise ModelTableError(f"unknown voice {voice!r}; served: {self.describe()}", "unknown_voice")
                voice = bare
            if voice not in self.model_of_voice:
                raise ModelTableError(f"unknown voice {voice!r}; served: {self.describe()}", "unknown_voice")
            if language and not self.model_of_voice[voice].serves_language(language):
                raise ModelTableError(f"voice {voice!r} does not speak {language!r}; served: {self.describe()}",
                                      "voice_language_mismatch")
            return voice
        if language:
            return self.voice_for_language(language)
        return default

    def voice_for_language(self, language: str) -> str:
        for spec in self.models.values():
            if spec.serves_language(language):
                return spec.default_voice
        raise ModelTableError(f"unknown language {language!r}; served: {self.describe()}", "unknown_language")

    def describe(self) -> str:
        """What is served, for error messages: `en (en-US): tara, leo; pt (pt-BR): ana`."""
        return "; ".join(f"{spec.name} ({', '.join(spec.languages)}): {', '.join(spec.voices)}"
                         for spec in self.models.values())

    def listing(self) -> list[dict[str, str]]:
        """`GET /v1/voices`' entries: each voice with its model, language and (a LoRA voice) adapter."""
        return [{"name": voice, "model": spec.lora_of or spec.name, "language": spec.language_of(voice),
                 **({"lora": spec.name} if spec.lora_of else {})}
                for voice, spec in self.model_of_voice.items()]


def table_file(table: ModelTable, urls: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """The table as a models file (`read_models_file`'s JSON form) whose models stream from `urls[name]`, checking
    that each server serves its model's path (`vllm serve PATH`'s served name): what `serve --workers` hands its
    workers after starting one `vllm serve` per model."""
    models: dict[str, dict[str, Any]] = {}
    for name, spec in table.bases.items():
        entry: dict[str, Any] = {"path": spec.path, "voices": list(spec.voices), "languages": list(spec.languages),
                                 "default_voice": spec.default_voice}
        for key in ("gpu_memory_utilization", "kv_cache_memory_gib", "temperature", "top_p", "repetition_penalty",
                    "max_streams"):
            if getattr(spec, key) is not None:
                entry[key] = getattr(spec, key)
        entry["vllm_urls"] = list(urls.get(name, spec.vllm_urls))
        entry["vllm_model"] = spec.vllm_model or (spec.path if name in urls else None)
        models[name] = {key: value for key, value in entry.items() if value is not None}
    loras = {spec.name: {"path": spec.path, "base": spec.lora_of, "voices": list(spec.voices),
                         "languages": list(spec.languages), "default_voice": spec.default_voice}
             for spec in table.models.values() if spec.lora_of is not None}
    return {"models": models, "loras": loras}


def build_table(model_entries: Sequence[str], models_file: str | None, single_path: str,
                single_voices: Sequence[str], lora_entries: Sequence[str] = ()) -> ModelTable:
    """The table of the settings: `NAME=PATH` entries and the models file's models (names unique across both);
    neither: today's one model (`single_path`, with `single_voices` when given). LoRA adapters: the models file's
    `[loras.NAME]` (on their `base`, default the first model) and `--lora NAME=PATH` (on the first model)."""
    specs: list[ModelSpec] = []
    loras: dict[str, dict[str, Any]] = {}
    for item in model_entries:
        name, path = parse_model_flag(item)
        specs.append(make_spec(name, {"path": path}))
    if models_file:
        models, loras = read_models_file(models_file)
        for name, values in models.items():
            specs.append(make_spec(name, values))
    if not specs:
        specs.append(make_spec(DEFAULT_MODEL_NAME, {"path": single_path, "voices": list(single_voices) or None}))
    by_name = {spec.name: spec for spec in specs}
    for item in lora_entries:
        name, path = parse_model_flag(item, "--lora")
        loras.setdefault(name, {"path": path})
    for name, values in loras.items():
        base = by_name.get(values.get("base", specs[0].name))
        if base is None:
            raise ModelTableError(f"lora {name!r}: base {values.get('base')!r} is not a model of the table "
                                  f"{list(by_name)}")
        specs.append(make_lora_spec(name, {k: v for k, v in values.items() if k != "base"}, base))
    return ModelTable(specs)
