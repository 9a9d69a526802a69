"""Reference SNAC decodes for checking the streaming decoder (`gateway.speech.snac`): `snac.SNAC.decode` with the
same position-tied noise, so that a full decode and a stream of the same codes compare sample by sample. Tests and
the GPU check scripts (tools/device) use it; the gateway's serving code never does.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from snac.layers import NoiseBlock

from gateway.orpheus import Frame, frames_to_layers
from gateway.speech.snac.layers import LATENT_PER_FRAME, position_noise


def _block_samples_per_frame(model: Any) -> list[int]:
    """Samples per Orpheus frame at the output of each decoder block (at each noise block)."""
    return [LATENT_PER_FRAME * r for r in itertools.accumulate(model.decoder_rates, lambda a, b: a * b)]


@contextlib.contextmanager
def position_tied_noise(model: torch.nn.Module, seeds: Sequence[int],
                        frame_offsets: Sequence[int] | None = None) -> Iterator[None]:
    """Within the block, the `snac.SNAC` `model`'s NoiseBlocks add `position_noise` instead of `torch.randn`:
    row b of a decode gets the noise of stream `seeds[b]` at absolute positions starting at Orpheus frame
    `frame_offsets[b]` (default 0), the noise `StreamingSnac` adds. For reference decodes (tests, checks)."""
    blocks = [m for m in model.modules() if isinstance(m, NoiseBlock)]
    per_frame = _block_samples_per_frame(model)
    offsets = list(frame_offsets) if frame_offsets is not None else [0] * len(seeds)

    def tied(block: Any, layer: int) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            length = x.shape[-1]
            seed_t = torch.tensor(list(seeds), dtype=torch.int64, device=x.device)
            first = torch.tensor(offsets, dtype=torch.int64, device=x.device) * per_frame[layer]
            pos = first[:, None] + torch.arange(length, device=x.device)[None, :]
            noise = position_noise(seed_t, layer, pos).to(x.dtype)[:, None, :]
            return x + noise * block.linear(x)

        return forward

    try:
        for layer, block in enumerate(blocks):
            block.forward = tied(block, layer)
        yield
    finally:
        for block in blocks:
            block.__dict__.pop("forward", None)


def reference_decode(model: torch.nn.Module, frames: Sequence[Sequence[Frame]], seeds: Sequence[int],
                     frame_offsets: Sequence[int] | None = None) -> np.ndarray:
    """`snac.SNAC.decode` of equal-length rows of frames, all at once, with position-tied noise: float32 audio
    [rows, 2048 * frames] on the host. With offsets 0 (an utterance from its start) this is the exact result
    the streaming decoder must reproduce."""
    layers = [frames_to_layers(row) for row in frames]
    device = next(model.parameters()).device
    codes = [torch.tensor([row[i] for row in layers], dtype=torch.int64, device=device) for i in range(3)]
    with torch.inference_mode(), position_tied_noise(model, seeds, frame_offsets):
        audio = model.decode(codes)
    return audio[:, 0, :].float().cpu().numpy()
