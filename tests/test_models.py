"""Several checkpoints on one gateway (issue 37): the model table's parsing and checks, and ONE gateway serving two
real tiny engines (an "English" and a "Portuguese" model with different voices, the session's pair of engines;
`serve --workers` starts its own from two checkpoints): each voice and language reaches
its own engine, a mixed EN+PT utterance plays its spans in order with words and visemes per span in its language,
its repeat asks no engine, and bad language/voice/markup gets an `error` event or a 4xx."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.config import ConfigError, GatewayConfig, add_arguments, from_sources
from gateway.devtools.client import HeadlessPeer
from gateway.edge.state import GatewayState
from gateway.model_table import LoraAdapter, ModelTableError, espeak_language
from gateway.orpheus import split_sentences
from gateway.rtc.session import Session
from gateway.speech.errors import InvalidRequestError
from gateway.speech.language_spans import parse_spans
from gateway.speech.synthesizer import Synthesizer
from tests.support import (
    TEST_STOP_PROBABILITY,
    chromium,
    needs_chromium,
    offer_sdp,
    on_shared_engines,
    open_page,
    running,
    tiny_config,
)

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
LORA_TOML = """
[loras.tutor]
path = "{lora}"
base = "en"
voices = ["tutor"]
"""
# The lesson page's lines (gateway/web/lesson.js) and the voice each is spoken by on a gateway of MODELS_TOML when
# the page's voice is tara: PT lines by the PT model's default voice, EN lines by tara.
LESSON_ROUTES = [("rui", "Bom dia! Como você está?"), ("tara", "Good morning! How are you?"),
                 ("rui", "Eu me chamo Ana. E você?"), ("tara", "Nice to meet you!"), ("rui", "Onde fica a estação?"),
                 ("tara", "Thank you, see you tomorrow.")]
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
    # Each engine has its own sequences: admission and the SNAC decoder's streams count both.
    from gateway.service.admission import Admission
    from gateway.speech.synthesizer import STREAM_SLOT_SPARE, decoder_settings

    assert Admission.from_config(config).max_streams == 2 * config.max_num_seqs
    assert decoder_settings(config).max_streams == 2 * config.max_num_seqs + STREAM_SLOT_SPARE
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
    (["--vllm-url", "http://gpu1:8001"], '[models.a]\npath = "/m/a"\n[models.b]\npath = "/m/b-fr"\n',
     "list each model's servers (vllm_urls) in --models-file"),
    ([], '[models.x]\npath = "/m/x"\nmax_streams = 0\n', "max_streams must be a whole number >= 1"),
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


def test_admission_holds_each_models_limit_within_the_total_across_workers(tmp_path: Path) -> None:
    """An utterance counts against its voice's model (a LoRA voice: its base's) and the total: `max_streams` of
    the models file, else an even share of the total; under `serve --workers` each model's count is every
    worker's (a `StreamCounts` column per model)."""
    from gateway.service.admission import Admission, StreamCounts, create_stream_counts, stream_count_columns
    from gateway.service.errors import CapacityError

    table = MODELS_TOML.format(en="/m/en", pt="/m/pt") + LORA_TOML.format(lora="/adapters/tutor")
    config = parse(["--models-file", write_models(tmp_path, table), "--max-num-seqs", "4"])
    assert Admission.from_config(config).model_limits == {"en": 4, "pt": 4}  # 8 in all, an even share each
    capped = parse(["--models-file", write_models(tmp_path, table.replace("temperature = 0.7",
                                                                          "temperature = 0.7\nmax_streams = 4")),
                    "--max-num-seqs", "4", "--max-in-flight-utterances", "5"])
    counts = tmp_path / "streams.counts"
    columns = stream_count_columns(capped)
    assert columns == 3 and stream_count_columns(parse(["--model", "/m/en"])) == 1
    create_stream_counts(counts, 2, columns)
    workers = [StreamCounts(counts, index, columns) for index in range(2)]
    try:
        first, second = (Admission.from_config(capped, shared) for shared in workers)
        assert first.model_limits == {"en": 3, "pt": 4}  # en: half of 5, rounded up; pt: its own
        slots = [admission.admit_stream(voice) for admission in (first, second) for voice in ("ana", "rui")]
        with pytest.raises(CapacityError) as refused:  # pt's 4: two in each worker
            first.admit_stream("ana")
        assert refused.value.model == "pt" and "model 'pt'" in str(refused.value) and refused.value.retry_after_s
        slots.append(second.admit_stream("tutor"))  # a LoRA voice counts as its base's (en)
        assert first.model_streams_in_use("en") == 1 and first.model_streams_in_use("pt") == 4
        with pytest.raises(CapacityError) as refused:
            first.admit_stream("leo")  # en has room, the total of 5 has none
        assert refused.value.model is None
        slots.pop(0).release()  # a pt utterance ends: pt and the total have room again
        first.admit_stream("rui").release()
        for slot in slots:
            slot.release()
        assert counts.read_bytes() == bytes(8 * 2 * columns)
    finally:
        for shared in workers:
            shared.close()


# --- one gateway, two real engines ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
async def two_models(two_tiny_engines: Synthesizer, tiny_model_dir: Path, tiny_snac_dir: Path,
                     tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[tuple[str, GatewayState]]:
    """The gateway of MODELS_TOML + LORA_TOML on the session's two tiny engines: en and pt each their own engine of
    the tiny checkpoint, tutor their adapter on en. pt samples as its engine does: MODELS_TOML's per-model
    temperature is the table tests' (`on_shared_engines` checks every engine setting)."""
    adapter = two_tiny_engines.table.engine_of("tutor")[1]
    assert adapter is not None
    table = MODELS_TOML.replace("temperature = 0.7\n", "").format(en=tiny_model_dir, pt=tiny_model_dir) + \
        LORA_TOML.format(lora=adapter.path)
    config = tiny_config(tiny_model_dir, tiny_snac_dir,
                         models_file=write_models(tmp_path_factory.mktemp("models"), table))
    async with running(config, on_shared_engines(config, two_tiny_engines)) as server:
        yield server


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
        assert {v["name"]: (v["model"], v["language"], v.get("lora")) for v in listing["models"]} == {
            "tara": ("en", "en-US", None), "leo": ("en", "en-US", None), "ana": ("pt", "pt-BR", None),
            "rui": ("pt", "pt-BR", None), "tutor": ("en", "en-US", "tutor")}
        for body, engine in [({"voice": "ana"}, "pt"), ({"voice": "pt/rui"}, "pt"), ({"language": "pt-BR"}, "pt"),
                             ({"voice": "leo"}, "en"), ({"language": "en-US"}, "en"), ({}, "en"),
                             ({"voice": "alloy"}, "en"),  # an OpenAI alias of an English voice
                             ({"voice": "tutor"}, "en")]:  # a LoRA voice: its base's engine, with the adapter
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
        # The LoRA voice ran as the adapter on the English engine (vLLM loaded it there), not as an engine of its own.
        assert gateway.synthesizer is not None and set(gateway.synthesizer.engines) == {"en", "pt"}
        assert set(await gateway.synthesizer.engines["en"]._llm.list_loras()) == {1}
        assert gateway.synthesizer.engines["pt"].config.lora == []  # the Portuguese engine runs no adapter
        # /metrics and /readyz per model.
        families = {f.name: f for f in text_string_to_metric_families(await (await client.get("/metrics")).text())}
        by_model = {name: {s.labels["model"]: s.value for s in families[name].samples if s.name.endswith("_total")
                           or name.endswith(("_ready", "_in_flight"))}
                    for name in ("orpheus_model_requests", "orpheus_model_audio_tokens", "orpheus_model_engine_ready")}
        assert by_model["orpheus_model_requests"] == {name: float(n) for name, n in counts(gateway).items()}
        assert by_model["orpheus_model_engine_ready"] == {"en": 1.0, "pt": 1.0}
        assert all(tokens > 0 for tokens in by_model["orpheus_model_audio_tokens"].values())
        assert (await (await client.get("/readyz")).json()) == {"status": "ready"}


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


async def cartesia_context(ws: aiohttp.ClientWebSocketResponse, context_id: str, **fields: Any) -> dict[str, Any]:
    """Send one whole-text context on Cartesia's socket; its last message (`done` or `error`)."""
    await ws.send_json({"context_id": context_id, "transcript": "Olá.", **fields})
    while True:
        message = await ws.receive_json(timeout=120)
        if message["context_id"] == context_id and message["done"]:
            return message


@pytest.mark.engine
async def test_cartesia_language_and_prefetch_route_through_the_table(
        peer: HeadlessPeer, two_models: tuple[str, GatewayState]) -> None:
    """Cartesia's ISO `language` and prefetch's BCP-47 `language` choose a model as `speak` does, with its errors."""
    base_url, gateway = two_models
    async with aiohttp.ClientSession(base_url) as client, client.ws_connect("/tts/websocket") as ws:
        for fields, engine in [({"language": "pt"}, "pt"), ({"language": "en", "voice": {"mode": "id", "id": "leo"}},
                                                            "en")]:
            before = counts(gateway)
            assert (await cartesia_context(ws, f"c-{engine}", **fields))["type"] == "done"
            assert added(before, gateway) == {"en": 0, "pt": 0, engine: 1}, fields
        for context_id, fields, code in [("c1", {"language": "ko"}, "unknown_language"),
                                         ("c2", {"language": "en", "voice": {"mode": "id", "id": "ana"}},
                                          "voice_language_mismatch"), ("c3", {"language": 7}, "invalid_language")]:
            error = await cartesia_context(ws, context_id, **fields)
            assert (error["type"], error["code"], error["status_code"]) == ("error", code, 400), error
        for body, status, code in [({"language": "ko"}, 400, "unknown_language"),
                                   ({"voice": "ana", "language": "en-US"}, 400, "voice_language_mismatch"),
                                   ({"language": "not a tag"}, 400, "invalid_prefetch"),
                                   ({"language": "pt-BR"}, 200, None)]:
            resp = await client.post("/v1/audio/prefetch", json={"texts": ["Olá."], **body})
            assert resp.status == status, await resp.text()
            answer = await resp.json()
            assert answer["error"]["code"] == code if code else answer["skipped"] == ["Olá."]
    peer.send({"type": "prefetch", "texts": ["Olá."], "language": "ko"})
    assert (await peer.wait_event("error", timeout=30))["code"] == "unknown_language"
    peer.send({"type": "prefetch", "texts": ["Olá."], "language": "pt-BR"})
    assert (await peer.wait_event("prefetched", timeout=30))["skipped"] == ["Olá."]  # this gateway keeps none


@pytest.mark.engine
async def test_a_model_at_its_limit_is_refused_by_name_while_the_others_speak(
        peer: HeadlessPeer, two_models: tuple[str, GatewayState]) -> None:
    """pt's utterance slots all taken (its share of the total): pt's voices get the busy error naming the model
    on every door, English voices still speak."""
    base_url, gateway = two_models
    admission, registry = gateway.admission, gateway.metrics.registry
    held = [admission.admit_stream("ana") for _ in range(admission.model_limits["pt"])]
    refusals = registry.get_sample_value("orpheus_model_refusals_total", {"model": "pt"}) or 0.0
    try:
        assert admission.streams_in_use < admission.max_streams
        async with aiohttp.ClientSession(base_url) as client:
            resp = await client.post("/v1/audio/speech", json={"input": "Olá.", "voice": "rui"})
            assert resp.status == 503 and int(resp.headers["Retry-After"]) > 0
            error = (await resp.json())["error"]
            assert error["code"] == "at_capacity" and "model 'pt'" in error["message"]
            resp = await client.post("/v1/audio/speech", json={"input": "Hello.", "voice": "tara",
                                                               "response_format": "pcm"})
            assert resp.status == 200 and len(await resp.read()) > 0
            async with client.ws_connect("/tts/websocket") as ws:
                error = await cartesia_context(ws, "c", language="pt-BR")
                assert (error["code"], error["status_code"]) == ("at_capacity", 503) and "'pt'" in error["error"]
        peer.speak("busy", "Olá.", language="pt-BR")
        error = await peer.wait_event("error", "busy", timeout=30)
        assert error["code"] == "at_capacity" and error["retry_after_s"] > 0 and "model 'pt'" in error["message"]
        assert registry.get_sample_value("orpheus_model_refusals_total", {"model": "pt"}) == refusals + 3
    finally:
        for slot in held:
            slot.release()
    peer.speak("free", "Olá.", language="pt-BR")
    await peer.wait_event("done", "free", timeout=120)


def test_workers_start_one_vllm_serve_per_model_and_hand_the_workers_their_servers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`serve --workers`: one `vllm serve` per model (its path, its memory share), and every worker's table streams
    each model from its own server, checking the server serves that model (the processes are not started here)."""
    from gateway.cluster.addressing import WORKER_CONFIG_ENV, WORKER_SOCKETS_ENV
    from gateway.cluster.supervisor import Supervisor
    from gateway.config import validate
    from gateway.speech.engine import RPC_FOLDER_ENV

    monkeypatch.setenv(WORKER_SOCKETS_ENV, str(tmp_path / "sockets"))
    monkeypatch.delenv(RPC_FOLDER_ENV, raising=False)  # an engine of this test process may have set its own
    (tmp_path / "sockets").mkdir()
    table = MODELS_TOML.format(en="/m/en", pt="/m/pt") + LORA_TOML.format(lora="/m/tutor")
    config = parse(["--models-file", write_models(tmp_path, table),
                    "--workers", "2", "--snac-placement", "process", "--gpu-memory-utilization", "0.8"])
    supervisor = Supervisor(config, 2)
    servers = [child for child in supervisor.children if child.name.startswith("vllm serve")]
    assert [child.name for child in servers] == ["vllm serve en", "vllm serve pt"]
    for child, path in zip(servers, ["/m/en", "/m/pt"], strict=True):
        cmd = child.cmd
        assert cmd[cmd.index("serve") + 1] == path
        assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.4"  # 0.8 split evenly
        assert cmd[cmd.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)  # the table's 0.25 GiB
    rpc_folder = servers[0].env[RPC_FOLDER_ENV]  # one private folder for every server's ipc sockets, made at run
    assert {child.env[RPC_FOLDER_ENV] for child in servers} == {rpc_folder} and not Path(rpc_folder).exists()
    assert servers[0].cmd[servers[0].cmd.index("--lora-modules") + 1] == "tutor=/m/tutor"  # the base serves it
    assert "--enable-lora" in servers[0].cmd and "--lora-modules" not in servers[1].cmd
    fields = json.loads(next(c for c in supervisor.children if c.name == "worker 0").env[WORKER_CONFIG_ENV])
    fields["vllm_urls"] = tuple(fields["vllm_urls"])
    worker = GatewayConfig(**fields)
    validate(worker)
    for name, child in zip(["en", "pt"], servers, strict=True):
        port = child.cmd[child.cmd.index("--port") + 1]
        model = worker.for_model(name)
        assert model.vllm_urls == (f"http://127.0.0.1:{port}",) and model.vllm_model == f"/m/{name}"
    assert worker.model_table.choose(None, "pt-BR", worker.voice) == "rui"
    assert worker.model_table.engine_of("tutor") == ("en", LoraAdapter("tutor", 1, "/m/tutor"))


def test_lora_adapters_run_on_their_base_engine(tmp_path: Path) -> None:
    from gateway.devtools.devmodels import build_test_lora
    from gateway.speech.engine import vllm_engine_settings

    lora = str(build_test_lora(tmp_path / "tutor", rank=8))
    config = parse(["--model", "/m/en", "--lora", f"tutor={lora}"])
    table = config.model_table
    assert list(table.bases) == ["default"] and config.voice == "tara"
    assert table.engine_of("tutor") == ("default", LoraAdapter("tutor", 1, lora))
    assert table.engine_of("tara") == ("default", None) and table.language_of("tutor") == "en-US"
    settings = vllm_engine_settings(config.for_model("default"), on_cpu=True)
    assert (settings["enable_lora"], settings["max_loras"], settings["max_lora_rank"]) == (True, 1, 8)
    assert "enable_lora" not in vllm_engine_settings(parse(["--model", "/m/en"]), on_cpu=True)
    for models, message in [(f'[models.en]\npath = "/m/en"\n[loras.t]\npath = "{lora}"\nbase = "fr"\n',
                             "base 'fr' is not a model of the table"),
                            (f'[models.en]\npath = "/m/en"\n[loras.t]\npath = "{lora}"\nvoices = ["tara"]\n',
                             "voice 'tara' is served by models 'en' and 't'"),
                            ('[models.en]\npath = "/m/en"\n[lora.t]\npath = "/x"\n', "unknown section(s) ['lora']")]:
        with pytest.raises(ConfigError) as caught:
            parse(["--models-file", write_models(tmp_path, models)])
        assert message in str(caught.value)


@pytest.mark.engine
@pytest.mark.browser
@needs_chromium
async def test_the_page_speaks_pt_lines_with_the_pt_model_and_en_lines_with_the_en_model(
        two_models: tuple[str, GatewayState]) -> None:
    """The lesson page in a real Chromium: its first line (PT) goes to the Portuguese engine, its second (EN) to the
    English one, the chosen (English) voice kept for the EN line."""
    base_url, gateway = two_models
    async with chromium() as browser:
        page, errors = await open_page(browser, base_url)
        await page.click("#connect")
        await page.wait_for_selector('body[data-state="ready"]', timeout=30_000)
        for index, engine in [(0, "pt"), (1, "en")]:
            before = counts(gateway)
            await page.locator(".phrase").nth(index).click()
            await page.wait_for_selector('#now[data-kind="done"]', timeout=180_000)
            assert added(before, gateway) == {"en": 0, "pt": 0, engine: 2}, index  # each line has two sentences
            await page.evaluate("document.getElementById('now').dataset.kind = ''")
        assert not errors, errors


@pytest.fixture(scope="module")
async def cached_two_models(two_models: tuple[str, GatewayState], tmp_path_factory: pytest.TempPathFactory
                            ) -> AsyncIterator[tuple[str, GatewayState]]:
    """A second gateway on the same two engines, with the phrase cache (`marked`: lines sent `cache: true`)."""
    import dataclasses

    shared = two_models[1]
    assert shared.synthesizer is not None
    config = dataclasses.replace(shared.config, phrase_cache="marked",
                                 phrase_cache_dir=str(tmp_path_factory.mktemp("phrases")))
    async with running(config, shared.synthesizer) as server:
        yield server


def hits(gateway: GatewayState) -> float:
    return gateway.metrics.registry.get_sample_value("orpheus_phrase_cache_hits_total") or 0.0


@pytest.mark.engine
async def test_mixed_utterance_spans_go_through_the_phrase_cache_by_their_own_voices(
        cached_two_models: tuple[str, GatewayState]) -> None:
    """A scripted mixed EN+PT line: each span's sentences are kept under their own voice (so their own model); said
    again, on the data channel or the speech route, it asks no engine, its words still placed in the text as sent."""
    base_url, gateway = cached_two_models
    peer = HeadlessPeer(base_url)
    await peer.connect()
    try:
        before, hit = counts(gateway), hits(gateway)
        peer.speak("m1", MIXED, cache=True)
        await peer.wait_event("done", "m1", timeout=180)
        assert added(before, gateway) == {"en": 2, "pt": 1}
        peer.speak("m2", MIXED, cache=True)
        await peer.wait_event("done", "m2", timeout=60)
        assert added(before, gateway) == {"en": 2, "pt": 1} and hits(gateway) == hit + 3
        assert [[w["text"] for w in ws] for ws in words_of(peer, "m2")] == \
            [["Good", "morning"], ["The", "word", "for", "station", "is"], ["estação"]]
        assert all(MIXED[w["char_start"]:w["char_end"]] == w["text"] for ws in words_of(peer, "m2") for w in ws)
        async with aiohttp.ClientSession(base_url) as client:
            resp = await client.post("/v1/audio/speech", json={"input": MIXED, "voice": "tara", "cache": True,
                                                               "response_format": "pcm"})
            assert resp.status == 200 and len(await resp.read()) > 0
        assert added(before, gateway) == {"en": 2, "pt": 1} and hits(gateway) == hit + 6
    finally:
        await peer.close()
    assert not peer.protocol_violations


@pytest.mark.engine
@pytest.mark.browser
@needs_chromium
async def test_prefetch_by_language_makes_the_lines_the_page_and_the_speech_route_then_hit(
        cached_two_models: tuple[str, GatewayState]) -> None:
    """With the phrase cache: a prefetch by `language` is made by that language's engine and the speech route's
    request with the same language hits it; the page prefetches its PT lines by the PT route and its EN lines by
    the EN one, so clicking a line asks no engine."""
    base_url, gateway = cached_two_models
    phrases = gateway.phrases
    assert phrases is not None
    async with aiohttp.ClientSession(base_url) as client:
        before, hit = counts(gateway), hits(gateway)
        body = {"texts": ["Até amanhã."], "language": "pt"}
        assert (await (await client.post("/v1/audio/prefetch", json=body)).json())["pending"] == body["texts"]
        await asyncio.wait_for(phrases.prefetch_idle(), 120)
        assert added(before, gateway) == {"en": 0, "pt": 1}
        resp = await client.post("/v1/audio/speech", json={"input": "Até amanhã.", "language": "pt-BR",
                                                           "cache": True, "response_format": "pcm"})
        assert resp.status == 200 and len(await resp.read()) > 0
        assert added(before, gateway) == {"en": 0, "pt": 1} and hits(gateway) == hit + 1
    async with chromium() as browser:
        page, errors = await open_page(browser, base_url)

        async def stored() -> list[bool]:  # the lesson's sentences, each keyed by the voice that will say it
            return [await phrases.lookup(phrases.key(voice, sentence)) is not None
                    for voice, line in LESSON_ROUTES for sentence in split_sentences(line, 300)]

        already, before = await stored(), counts(gateway)  # the mixed line's "Good morning!" may be there
        await page.click("#connect")
        await page.wait_for_selector('body[data-state="ready"]', timeout=30_000)
        async with asyncio.timeout(300):
            while not all(await stored()):  # noqa: ASYNC110 (the store signals nothing)
                await asyncio.sleep(0.2)
        await asyncio.wait_for(phrases.prefetch_idle(), 120)
        voices = [voice for voice, line in LESSON_ROUTES for _ in split_sentences(line, 300)]
        assert added(before, gateway) == {  # each sentence made once, by its own line's language's engine
            model: sum(1 for voice, there in zip(voices, already, strict=True)
                       if not there and (voice == "rui") == (model == "pt")) for model in ("en", "pt")}
        for index in range(2):  # a PT line, then an EN line: both made already
            before = counts(gateway)
            await page.locator(".phrase").nth(index).click()
            await page.wait_for_selector('#now[data-kind="done"]', timeout=60_000)
            assert added(before, gateway) == {"en": 0, "pt": 0}, index
            await page.evaluate("document.getElementById('now').dataset.kind = ''")
        assert hits(gateway) == hit + 1 + 4  # each line's two sentences
        assert not errors, errors


@pytest.mark.engine
async def test_serve_workers_starts_one_vllm_serve_per_model_and_routes_to_each(
        tiny_model_dir: Path, tiny_snac_dir: Path, tmp_path: Path) -> None:
    """`serve --workers 2 --models-file` for real: one `vllm serve` per model started and supervised, the workers
    stream each voice from its own model's server, and /metrics counts each model's requests."""
    import asyncio
    import sys
    import time

    import psutil

    from gateway.cluster.addressing import WORKER_SOCKETS_ENV
    from gateway.devtools.devmodels import build_test_model
    from gateway.speech.engine import RPC_FOLDER_ENV
    from tests.support import cli_env, free_port, start_process_group, stop_process_group

    pt_dir = build_test_model(tmp_path / "pt", shape="tiny", seed=1, stop_probability=TEST_STOP_PROBABILITY)
    models = write_models(tmp_path, MODELS_TOML.format(en=tiny_model_dir, pt=pt_dir))
    (tmp_path / "sockets").mkdir()
    port = free_port()
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "gateway", "serve", "--workers", "2", "--models-file", models, "--host", "127.0.0.1",
           "--port", str(port), "--snac-model", str(tiny_snac_dir), "--snac-device", "cpu", "--snac-placement",
           "shared", "--warmup-batch-sizes", "2", "--log-level", "warning"]
    env = {k: v for k, v in cli_env().items() if k != RPC_FOLDER_ENV}  # the supervisor's own folder for them
    proc = start_process_group(cmd, {**env, WORKER_SOCKETS_ENV: str(tmp_path / "sockets")}, log)
    try:
        servers = []
        deadline = time.monotonic() + 600
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
            while True:
                assert proc.poll() is None, log.read_text()[-4000:]
                assert time.monotonic() < deadline, log.read_text()[-4000:]
                with contextlib.suppress(aiohttp.ClientError, OSError, asyncio.TimeoutError):
                    async with client.get("/readyz") as resp:
                        if resp.status == 200:
                            break
                await asyncio.sleep(1)
            servers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "serve" in p.cmdline() and "gateway.cluster.vllm_cli" in p.cmdline()]
            assert sorted(p.cmdline()[p.cmdline().index("serve") + 1] for p in servers) == \
                sorted([str(tiny_model_dir), str(pt_dir)])
            for voice in ["ana", "tara", "rui"]:
                resp = await client.post("/v1/audio/speech", json={"input": "Olá.", "voice": voice,
                                                                   "response_format": "pcm"})
                assert resp.status == 200, await resp.text()
                assert len(await resp.read()) > 0
            text = await (await client.get("/metrics")).text()
        requests = {"en": 0.0, "pt": 0.0}  # each worker's samples, labelled by worker: summed by model
        for family in text_string_to_metric_families(text):
            if family.name == "orpheus_model_requests":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        requests[sample.labels["model"]] += sample.value
        assert requests == {"en": 1.0, "pt": 2.0}, requests
        rpc_folders = {Path(p.environ()[RPC_FOLDER_ENV]) for p in servers}  # the supervisor's, not the temp folder
        assert len(rpc_folders) == 1 and any(path.is_socket() for path in next(iter(rpc_folders)).iterdir())
    finally:
        stop_process_group(proc)
    assert not [folder for folder in rpc_folders if folder.exists()]  # removed at stop
