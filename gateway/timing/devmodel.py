"""A tiny random wav2vec2 CTC checkpoint for tests: the same files a real `...ForCTC` checkpoint has
(config + weights, vocab.json + tokenizer config, preprocessor config), loadable offline with
`AutoModelForCTC.from_pretrained` / `AutoProcessor.from_pretrained`. Its emissions are random, so it tests
the plumbing (loading, resampling, feature extraction, frame rate, token mapping, alignment), not accuracy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

BLANK = "<pad>"
BOS = "<s>"
EOS = "</s>"
UNKNOWN = "<unk>"
WORD_DELIMITER = "|"
# Letters of English and Portuguese, lower case; `'` for contractions.
DEFAULT_LETTERS: tuple[str, ...] = (
    *"abcdefghijklmnopqrstuvwxyz'",
    *"áàâãéêíóôõúüç",
)


def default_vocab(letters: Sequence[str] = DEFAULT_LETTERS) -> list[str]:
    """The layout of the public wav2vec2 checkpoints: blank `<pad>` (id 0), `<s>`, `</s>`, `<unk>`, the word
    delimiter `|`, then the letters."""
    return [BLANK, BOS, EOS, UNKNOWN, WORD_DELIMITER, *letters]


def build_tiny_ctc_model(path: str | Path, vocab: Sequence[str] | None = None, sampling_rate: int = 16000,
                         seed: int = 0) -> Path:
    """Write a random `Wav2Vec2ForCTC` (hidden 32, 2 layers, 3 conv layers of total stride 320 = 20 ms frames
    at 16 kHz, like the real ones) and its processor files to `path`; returns `path`.

    `vocab`: the token strings in id order; must contain `<pad>` (the CTC blank); `<unk>` and `|` are used
    when present. Default: `default_vocab()`. Takes about 1 s (most of it importing transformers)."""
    import torch
    from transformers import (
        Wav2Vec2Config,
        Wav2Vec2CTCTokenizer,
        Wav2Vec2FeatureExtractor,
        Wav2Vec2ForCTC,
        Wav2Vec2Processor,
    )

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokens = list(vocab) if vocab is not None else default_vocab()
    if BLANK not in tokens:
        raise ValueError(f"vocab needs the blank token {BLANK!r}")
    if len(set(tokens)) != len(tokens):
        raise ValueError("vocab has duplicate tokens")
    vocab_file = out / "vocab.json"
    vocab_file.write_text(json.dumps({t: i for i, t in enumerate(tokens)}, ensure_ascii=False), encoding="utf-8")

    config = Wav2Vec2Config(
        vocab_size=len(tokens),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 8, 8),
        conv_kernel=(10, 8, 8),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        feat_extract_norm="group",
        do_stable_layer_norm=False,
        pad_token_id=tokens.index(BLANK),
        ctc_loss_reduction="mean",
        mask_time_prob=0.0,
    )
    torch.manual_seed(seed)
    model = Wav2Vec2ForCTC(config)
    model.save_pretrained(out)

    tokenizer = Wav2Vec2CTCTokenizer(
        str(vocab_file),
        unk_token=UNKNOWN if UNKNOWN in tokens else BLANK,
        pad_token=BLANK,
        bos_token=BOS if BOS in tokens else None,
        eos_token=EOS if EOS in tokens else None,
        word_delimiter_token=WORD_DELIMITER,
        do_lower_case=False,
    )
    feature_extractor = Wav2Vec2FeatureExtractor(
        feature_size=1, sampling_rate=sampling_rate, padding_value=0.0, do_normalize=True,
        return_attention_mask=False,
    )
    Wav2Vec2Processor(feature_extractor=feature_extractor, tokenizer=tokenizer).save_pretrained(out)
    feature_extractor.save_pretrained(out)  # preprocessor_config.json, as the public checkpoints have it
    return out
