"""Prompt format, voices, sentence splitting and token parsing (no engine)."""

from __future__ import annotations

import pytest

from gateway.orpheus import (
    AUDIO_TOKEN_BASE,
    AUDIO_TOKEN_END,
    END_OF_SPEECH_ID,
    START_OF_SPEECH_ID,
    AudioTokenParser,
    SentenceSplitter,
    audio_token_id,
    build_prompt,
    frames_to_layers,
    sentence_token_cap,
    split_sentences,
    voices_for_model,
)


class FakeTokenizer:
    """Byte tokenizer: enough to check the prompt's layout around the text ids."""

    bos_token_id = 128000

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())


def frame_ids(frame_index: int, codes: tuple[int, ...] | None = None) -> list[int]:
    codes = codes or tuple((frame_index * 7 + k) % 4096 for k in range(7))
    return [audio_token_id(k, c) for k, c in enumerate(codes)]


def test_prompt_layout() -> None:
    ids = build_prompt(FakeTokenizer(), "tara", "Hi <laugh>")
    assert ids[:2] == [128259, 128000]
    assert bytes(ids[2:-4]).decode() == "tara: Hi <laugh>"
    assert ids[-4:] == [128009, 128260, 128261, 128257]


def test_voices_per_checkpoint() -> None:
    assert voices_for_model("canopylabs/orpheus-3b-0.1-ft")[0] == "tara"
    assert voices_for_model("canopylabs/3b-fr-ft-research_release") == ["pierre", "amelie", "marie"]
    assert "준서" in voices_for_model("canopylabs/3b-ko-ft-research_release")
    assert "giulia" in voices_for_model("/models/3b-es_it-ft-research_release/")
    assert voices_for_model("/tmp/some-local-model")[0] == "tara"


def test_parser_whole_frames_and_stop() -> None:
    parser = AudioTokenParser()
    ids = frame_ids(0) + frame_ids(1) + [END_OF_SPEECH_ID] + frame_ids(2)
    frames = parser.feed(ids[:5]) + parser.feed(ids[5:])
    assert len(frames) == 2
    assert frames[0] == tuple(range(7))
    assert parser.finished
    assert parser.stats.dropped_tokens == 0


def test_parser_keeps_code_zero_and_max_code() -> None:
    parser = AudioTokenParser()
    frames = parser.feed(frame_ids(0, (0, 0, 0, 0, 0, 0, 0)) + frame_ids(1, (4095,) * 7))
    assert frames == [(0,) * 7, (4095,) * 7]


def test_parser_resynchronises_on_wrong_slot() -> None:
    parser = AudioTokenParser()
    good0, good1, good2 = frame_ids(0), frame_ids(1), frame_ids(2)
    broken = good1[:3] + good1[4:]  # slot 3 missing: the rest of this frame is unusable
    frames = parser.feed(good0 + broken + good2)
    # Position counting would shift every later frame; parsing by id loses only the broken one.
    assert frames == [tuple(c - AUDIO_TOKEN_BASE - 4096 * k for k, c in enumerate(f)) for f in (good0, good2)]
    assert parser.stats.dropped_tokens == 6


def test_parser_ignores_non_audio_ids_and_out_of_range() -> None:
    parser = AudioTokenParser()
    ids = [START_OF_SPEECH_ID, 128263, *frame_ids(0)[:3], 5, *frame_ids(0)[3:], AUDIO_TOKEN_END]
    frames = parser.feed(ids)
    assert len(frames) == 1
    assert parser.stats.ignored_ids == 4


def test_parser_trailing_partial_frame_counted() -> None:
    parser = AudioTokenParser()
    parser.feed(frame_ids(0) + frame_ids(1)[:4])
    parser.finish()
    assert parser.stats.frames == 1
    assert parser.stats.dropped_tokens == 4


def test_frames_to_layers_order() -> None:
    l0, l1, l2 = frames_to_layers([(0, 1, 2, 3, 4, 5, 6), (10, 11, 12, 13, 14, 15, 16)])
    assert l0 == [0, 10]
    assert l1 == [1, 4, 11, 14]
    assert l2 == [2, 3, 5, 6, 12, 13, 15, 16]


def test_sentence_token_cap_is_whole_frames_within_max_tokens() -> None:
    assert sentence_token_cap(70, 6.0, 2400) == 420
    assert sentence_token_cap(1, 1.0, 2400) == 7, "at least one frame"
    assert sentence_token_cap(10_000, 6.0, 2400) == 2394, "whole frames under max_tokens"
    assert sentence_token_cap(70, 0.0, 140) == 140


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
        ("Olá, tudo bem? Eu sou a Ana.", ["Olá, tudo bem?", "Eu sou a Ana."]),
        ("It costs 3.50 euros. Dr. Silva agrees.", ["It costs 3.50 euros.", "Dr. Silva agrees."]),
        ("你好。我是老师！", ["你好。", "我是老师！"]),
        ("No punctuation at all", ["No punctuation at all"]),
        ("Tags stay <laugh> intact. Yes <sigh>.", ["Tags stay <laugh> intact.", "Yes <sigh>."]),
        ("  \n ", []),
    ],
)
def test_split_sentences(text: str, expected: list[str]) -> None:
    assert split_sentences(text) == expected


def test_long_sentence_split_at_soft_breaks() -> None:
    text = "one two three, " * 40
    pieces = split_sentences(text, max_sentence_chars=100)
    assert all(len(p) <= 100 for p in pieces)
    assert " ".join(pieces).split() == text.split()


def test_incremental_splitter_emits_when_complete() -> None:
    splitter = SentenceSplitter()
    assert splitter.feed("Good morn") == []
    assert splitter.feed("ing, class. Today we") == ["Good morning, class."]
    assert splitter.feed(" learn verbs.") == []  # no space after the dot yet: could be "verbs.com"
    assert splitter.feed(" ") == ["Today we learn verbs."]
    assert splitter.feed("Bye") == []
    assert splitter.flush() == ["Bye"]
