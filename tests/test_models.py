"""Several checkpoints on one gateway (issue 37): the model table's parsing and checks, and ONE gateway serving two
real tiny engines (an "English" and a "Portuguese" checkpoint with different voices): each voice and language reaches
its own engine, a mixed EN+PT utterance plays its spans in order with words and visemes per span in its language,
its repeat asks no engine, and bad language/voice/markup gets an `error` event or a 4xx."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.config import ConfigError, GatewayConfig, add_arguments, from_sources
from gateway.devtools.client import HeadlessPeer
from gateway.edge.state import GatewayState
from gateway.model_table import ModelTableError, espeak_language
from gateway.rtc.session import Session
from gateway.speech.errors import InvalidRequestError
from gateway.speech.language_spans import parse_spans
from gateway.speech.synthesizer import Synthesizer
from tests.support import TEST_STOP_PROBABILITY, offer_sdp, running, tiny_config

MODELS_TOML = """
[models.en]
path = "{en}"
voices = ["tara", "leo"]
languages = ["en-US"]
kv_cache_memory_gib = 0.25

[models.pt]
path = "{pt}"
voices = ["ana", "rui"]
languages = ["pt-BR"]
default_voice = "rui"
kv_cache_memory_gib = 0.25
temperature = 0.7
"""
MIXED = 'Good morning! The word for station is <lang xml:lang="pt-BR">estação</lang>.'


def parse(argv: list[str], env: dict[str, str] | None = None) -> GatewayConfig:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return from_sources(parser.parse_args(argv), env=env or {})


def write_models(tmp_path: Path, text: str, suffix: str = ".toml") -> str:
    path = tmp_path / f"models{suffix}"
    path.write_text(text)
    return str(path)


# --- the table (no engine) ---------------------------------------------------------------------------------------

def test_plain_model_stays_the_one_model() -> None:
    config = parse(["--model", "/models/orpheus-en"])
    assert config.model == "/models/orpheus-en" and config.model_entries == []
    assert list(config.model_table.models) == ["default"] and config.voice == "tara"


def test_named_models_make_a_table_with_voices_from_their_names() -> None:
    config = parse(["--model", "en=/m/orpheus-3b-0.1-ft", "--model", "fr=/m/3b-fr-ft-research_release"])
    table = config.model_table
    assert config.model == "/m/orpheus-3b-0.1-ft" and list(table.models) == ["en", "fr"]
    assert table.models["fr"].voices == ("pierre", "amelie", "marie") and table.models["fr"].languages == ("fr-FR",)
    assert table.choose(None, "fr", config.voice) == "pierre"
    assert table.choose("fr/marie", None, config.voice) == "marie"
    assert config.language_of("amelie") == "fr-fr" and config.language_of("leo") == "en-us"
    # The environment gives the same, comma-separated; a share is each engine's even split of the GPU.
    env = parse([], {"ORPHEUS_GATEWAY_MODEL": "en=/m/orpheus-3b-0.1-ft,fr=/m/3b-fr-ft-research_release",
                     "ORPHEUS_GATEWAY_GPU_MEMORY_UTILIZATION": "0.8"})
    assert list(env.model_table.models) == ["en", "fr"]
    assert env.for_model("fr").gpu_memory_utilization == pytest.approx(0.4)
    assert env.for_model("fr").model == "/m/3b-fr-ft-research_release"


def test_models_file_sets_voices_languages_sampling_and_shares(tmp_path: Path) -> None:
    config = parse(["--models-file", write_models(tmp_path, MODELS_TOML.format(en="/m/en", pt="/m/pt"))])
    assert config.voice_list == ["tara", "leo", "ana", "rui"] and config.voice == "tara"
    assert config.model_table.choose(None, "pt-BR", "tara") == "rui"  # pt's default voice
    assert config.model_table.choose(None, "pt", "tara") == "rui"  # the primary subtag matches
    assert config.language_of("ana") == "pt-br"
    pt = config.for_model("pt")
    assert (pt.model, pt.temperature, pt.kv_cache_memory_gib, pt.voice) == ("/m/pt", 0.7, 0.25, "rui")
    assert config.for_model("en").temperature == config.temperature
    same = parse(["--models-file", write_models(tmp_path, json.dumps({"models": {
        "en": {"path": "/m/en", "voices": ["tara", "leo"]}, "pt": {"path": "/m/pt", "voices": ["ana"],
                                                                   "languages": ["pt-BR"]}}}), ".json")])
    assert same.model_table.listing() == [
        {"name": "tara", "model": "en", "language": "en-US"}, {"name": "leo", "model": "en", "language": "en-US"},
        {"name": "ana", "model": "pt", "language": "pt-BR"}]


@pytest.mark.parametrize(("argv", "models", "message"), [
    (["--model", "en=/m/a", "--model", "en2=/m/b"], None, "voice 'tara' is served by models 'en' and 'en2'"),
    (["--model", "en=/m/a", "--model", "en=/m/b-fr"], None, "model 'en' is named twice"),
    (["--model", "en=/m/a", "--model", "/m/b"], None, "is not NAME=PATH_OR_HF_ID"),
    ([], '[models.x]\npath = "/m/x"\nvoice = ["a"]\n', "unknown field(s) ['voice']"),
    ([], '[models.x]\nvoices = ["a"]\n', "'path' (an HF id or a local path) is required"),
    ([], '[models.x]\npath = "/m/x"\nlanguages = ["not a tag"]\n', "is not a BCP-47 language tag"),
    ([], '[models.x]\npath = "/m/x"\ndefault_voice = "nobody"\n', "default_voice 'nobody' is not among"),
    ([], '[models.a]\npath = "/m/a"\ngpu_memory_utilization = 0.6\n[models.b]\npath = "/m/b-fr"\n'
         'gpu_memory_utilization = 0.6\n', "shares add up to 1.2"),
    ([], '[models.a]\npath = "/m/a"\nvllm_urls = ["http://gpu1:8001"]\n[models.b]\npath = "/m/b-fr"\n',
     "either every model lists its vllm_urls"),
    ([], "models = 3\n", "needs a non-empty 'models' table"),
    ([], "[models.a\n", "not valid TOML"),
])
def test_bad_tables_are_refused_at_start_up(tmp_path: Path, argv: list[str], models: str | None,
                                            message: str) -> None:
    if models is not None:
        argv = [*argv, "--models-file", write_models(tmp_path, models)]
    with pytest.raises(ConfigError, match=None) as caught:
        parse(argv)
    assert message in str(caught.value)


def test_routing_errors_list_what_is_served(tmp_path: Path) -> None:
    table = parse(["--models-file", write_models(tmp_path, MODELS_TOML.format(en="/m/en", pt="/m/pt"))]).model_table
    for voice, language, code in [("nobody", None, "unknown_voice"), (None, "ko-KR", "unknown_language"),
                                  ("ana", "en-US", "voice_language_mismatch"), ("en/ana", None, "unknown_voice")]:
        with pytest.raises(ModelTableError) as caught:
            table.choose(voice, language, "tara")
        assert caught.value.code == code
        assert "en (en-US): tara, leo; pt (pt-BR): ana, rui" in str(caught.value)


def test_lang_markup_spans_index_the_text_as_sent() -> None:
    spans = parse_spans(MIXED + " <laugh> Right?")
    assert [(MIXED + " <laugh> Right?")[s.start:s.end] for s in spans] == \
        ["Good morning! The word for station is ", "estação", ". <laugh> Right?"]
    assert [s.language for s in spans] == [None, "pt-BR", None]
    assert espeak_language("pt-BR") == "pt-br" and espeak_language("zh") == "cmn"
    for bad in ["<lang>x</lang>", "x </lang>", '<lang xml:lang="pt">x', '<lang xml:lang="pt">a<lang xml:lang="en">b'
                '</lang></lang>', '<lang xml:lang="not a tag">x</lang>']:
        with pytest.raises(InvalidRequestError) as caught:
            parse_spans(bad)
        assert caught.value.code == "invalid_markup"


# --- one gateway, two real engines ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def two_models(tiny_model_dir: Path, tiny_snac_dir: Path, tmp_path_factory: pytest.TempPathFactory
                     ) -> AsyncIterator[tuple[str, GatewayState]]:
    from gateway.devtools.devmodels import build_test_model

    pt_dir = build_test_model(tmp_path_factory.mktemp("tiny-orpheus-pt"), shape="tiny", seed=1,
                              stop_probability=TEST_STOP_PROBABILITY)
    folder = tmp_path_factory.mktemp("models")
    config = tiny_config(tiny_model_dir, tiny_snac_dir,
                         models_file=write_models(folder, MODELS_TOML.format(en=tiny_model_dir, pt=pt_dir)))
    synthesizer = Synthesizer.load(config)
    await synthesizer.start()
    try:
        async with running(config, synthesizer) as server:
            yield server
    finally:
        await synthesizer.close()


def counts(gateway: GatewayState) -> dict[str, int]:
    assert gateway.synthesizer is not None
    return {name: engine.requests_started for name, engine in gateway.synthesizer.engines.items()}


def added(before: dict[str, int], gateway: GatewayState) -> dict[str, int]:
    return {name: n - before[name] for name, n in counts(gateway).items()}


@pytest.fixture()
async def peer(two_models: tuple[str, GatewayState]) -> AsyncIterator[HeadlessPeer]:
    p = HeadlessPeer(two_models[0])
    await p.connect()
    yield p
    await p.close()
    assert not p.protocol_violations


@pytest.mark.engine
async def test_each_voice_and_language_reaches_its_own_engine(two_models: tuple[str, GatewayState]) -> None:
    base_url, gateway = two_models
    async with aiohttp.ClientSession(base_url) as client:
        listing = await (await client.get("/v1/voices")).json()
        assert listing["languages"] == ["en-US", "pt-BR"]
        assert {v["name"]: (v["model"], v["language"]) for v in listing["models"]} == {
            "tara": ("en", "en-US"), "leo": ("en", "en-US"), "ana": ("pt", "pt-BR"), "rui": ("pt", "pt-BR")}
        for body, engine in [({"voice": "ana"}, "pt"), ({"voice": "pt/rui"}, "pt"), ({"language": "pt-BR"}, "pt"),
                             ({"voice": "leo"}, "en"), ({"language": "en-US"}, "en"), ({}, "en"),
                             ({"voice": "alloy"}, "en")]:  # an OpenAI alias of an English voice
            before = counts(gateway)
            resp = await client.post("/v1/audio/speech", json={"input": "Bom dia.", "response_format": "pcm",
                                                               **body})
            assert resp.status == 200, await resp.text()
            assert len(await resp.read()) > 0
            assert added(before, gateway) == {"en": 0, "pt": 0, engine: 1}, body
        for body, code in [({"voice": "nobody"}, "unknown_voice"), ({"language": "ko"}, "unknown_language"),
                           ({"voice": "ana", "language": "en-US"}, "voice_language_mismatch"),
                           ({"input": "<lang>x</lang>"}, "invalid_markup"),
                           ({"input": '<lang xml:lang="ko">x</lang>'}, "unknown_language")]:
            resp = await client.post("/v1/audio/speech", json={"input": "Bom dia.", **body})
            assert resp.status == 400
            error = (await resp.json())["error"]
            assert error["code"] == code and ("served" in error["message"] or code == "invalid_markup")
        resp = await client.post("/v1/webrtc/offer", json={"sdp": await offer_sdp(), "type": "offer",
                                                           "language": "ko"})
        assert resp.status == 400 and (await resp.json())["error"]["code"] == "unknown_language"


def session_of(gateway: GatewayState, peer: HeadlessPeer) -> Session:
    return gateway.sessions.sessions[peer.session_id]


def words_of(peer: HeadlessPeer, utterance_id: str) -> list[list[dict[str, Any]]]:
    return [e.message["words"] for e in peer.find("words", utterance_id)]


@pytest.mark.engine
async def test_mixed_utterance_plays_its_spans_in_order_and_repeats_without_an_engine(
        peer: HeadlessPeer, two_models: tuple[str, GatewayState]) -> None:
    gateway = two_models[1]
    before = counts(gateway)
    peer.speak("m", MIXED)
    done = await peer.wait_event("done", "m", timeout=180)
    assert added(before, gateway) == {"en": 2, "pt": 1}  # "Good morning!", "The word ... is" | "estação"
    assert [e.message["text"] for e in peer.find("segment", "m")] == \
        ["Good morning!", "The word for station is", "estação"]
    per_sentence = words_of(peer, "m")
    assert [[w["text"] for w in ws] for ws in per_sentence] == \
        [["Good", "morning"], ["The", "word", "for", "station", "is"], ["estação"]]
    for ws in per_sentence:  # offsets into the text as sent, markup and all
        for w in ws:
            assert MIXED[w["char_start"]:w["char_end"]] == w["text"]
    assert {e.message["index"] for e in peer.find("visemes", "m")} == {0, 1, 2}
    recording = session_of(gateway, peer).timelines.cache.get("m")
    assert recording is not None
    assert [s.language for s in recording.sentences] == [None, None, "pt-br"]  # the span's own espeak voice
    assert done["heard_text"] == MIXED[:per_sentence[-1][-1]["char_end"]]

    before = counts(gateway)
    peer.repeat("m", new_id="m-again")
    again = await peer.wait_event("done", "m-again", timeout=60)
    assert added(before, gateway) == {"en": 0, "pt": 0}, "a repeat asks no engine"
    assert again["audio_ms"] == done["audio_ms"]
    assert [[w["text"] for w in ws] for ws in words_of(peer, "m-again")] == \
        [[w["text"] for w in ws] for ws in per_sentence]


@pytest.mark.engine
async def test_speak_routes_language_and_refuses_what_is_not_served(
        peer: HeadlessPeer, two_models: tuple[str, GatewayState]) -> None:
    gateway = two_models[1]
    before = counts(gateway)
    peer.speak("pt", "Bom dia.", language="pt-BR")
    await peer.wait_event("done", "pt", timeout=120)
    assert added(before, gateway) == {"en": 0, "pt": 1}
    for utterance_id, fields, code in [
            ("e1", {"voice": "nobody"}, "unknown_voice"), ("e2", {"language": "ko"}, "unknown_language"),
            ("e3", {"voice": "ana", "language": "en-US"}, "voice_language_mismatch"),
            ("e4", {"text": '<lang xml:lang="pt-BR">sem fim'}, "invalid_markup"),
            ("e5", {"text": '<lang xml:lang="ko">x</lang>'}, "unknown_language"),
            ("e6", {"text": '<lang xml:lang="pt-BR">a</lang>', "more": True}, "invalid_markup")]:
        peer.speak(utterance_id, fields.pop("text", "Olá."), **fields)
        error = await peer.wait_event("error", utterance_id, timeout=30)
        assert error["code"] == code, error
    assert added(before, gateway) == {"en": 0, "pt": 1}
