"""The benchmarks' baseline: SNAC decoding of sliding 3-frame windows, as the gateway decoded before the exact
streaming decoder (`gateway.speech.snac`) replaced it. Not part of the gateway; kept so that
`snac_stream_bench.py`, `snac_profile.py`, `snac_check.py` and `contention.py` time the old decoder against the new
one on the same GPU.

A window of T frames is one row of 7 T codes: L0 (T codes), then L1 (2 T), then L2 (4 T), each layer in the order of
`gateway.orpheus.frames_to_layers`. `SnacModel.decode_codes` decodes a batch of equal-length rows in one pass (the
whole window's samples, context and lookahead included); on CUDA, `capture_graphs` first captures that pass for
each window length and a ladder of batch sizes, so a decode is one copy in, one graph replay and one copy out.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gateway.orpheus import SLOTS_PER_FRAME, frames_to_layers
from gateway.speech.snac import INT16_MAX, snac_device_and_dtype

log = logging.getLogger(__name__)

GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# Codes per frame in each SNAC layer (1, 2, 4), as `frames_to_layers` lays them out.
LAYER_CODES_PER_FRAME = tuple(len(layer) for layer in frames_to_layers([tuple(range(SLOTS_PER_FRAME))]))


def _decode_to_pcm(model: Any, codes: torch.Tensor, frames: int) -> torch.Tensor:
    """SNAC-decode window rows (module docstring) into int16 PCM [batch, samples], all on the device."""
    bounds = [b * frames for b in itertools.accumulate((0, *LAYER_CODES_PER_FRAME))]
    layers = [codes[:, a:b].contiguous() for a, b in itertools.pairwise(bounds)]
    audio = model.decode(layers)[:, 0, :].float()
    return (audio.clamp(-1.0, 1.0) * INT16_MAX).to(torch.int16)


class _GraphedDecoder:
    """The SNAC decoder captured as CUDA graphs for one window length and a ladder of batch sizes.

    A batch is padded up to the next captured size and replayed. A decode is three GPU submissions: one
    host-to-device copy of the codes (from pinned memory), one graph replay (decoder + conversion to int16)
    and one device-to-host copy of the PCM.
    """

    def __init__(self, model: Any, device: str, frames: int, max_batch: int, pool: Any = None) -> None:
        self.frames = frames
        self.sizes = sorted({b for b in GRAPH_BATCH_BUCKETS if b < max_batch} | {max_batch})
        width = frames * sum(LAYER_CODES_PER_FRAME)
        self._staging = torch.zeros((self.sizes[-1], width), dtype=torch.long).pin_memory()
        self._graphs: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):  # largest first, so smaller graphs fit in its memory pool
                codes = torch.zeros((size, width), dtype=torch.long, device=device)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        _decode_to_pcm(model, codes, frames)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    pcm = _decode_to_pcm(model, codes, frames)
                self._graphs[size] = (graph, codes, pcm)

    def fits(self, frames: int, batch: int) -> bool:
        return frames == self.frames and batch <= self.sizes[-1]

    def __call__(self, codes: np.ndarray) -> np.ndarray:
        """int16 PCM [batch, samples] of window rows `codes` ([batch, 7 * frames])."""
        batch = codes.shape[0]
        size = next(s for s in self.sizes if s >= batch)
        graph, static_codes, static_pcm = self._graphs[size]
        staging = self._staging[:batch]
        staging.numpy()[:] = codes  # the previous call's copy from here finished: it ended with a sync
        static_codes[:batch].copy_(staging, non_blocking=True)
        graph.replay()
        return static_pcm[:batch].cpu().numpy()  # copies out before the buffer is replayed into again


class SnacModel:
    """The SNAC decoder on one device; turns batches of equal-length windows into int16 PCM."""

    def __init__(self, model: Any, device: str) -> None:
        self.model = model
        self.device = device
        self._graphed: list[_GraphedDecoder] = []

    @classmethod
    def load(cls, name_or_path: str, device: str = "auto", dtype: str = "auto") -> SnacModel:
        """`dtype`: the decoder's weights and activations ("auto": as the gateway's `--snac-dtype auto`)."""
        from snac import SNAC

        device, dtype = snac_device_and_dtype(device, dtype)
        model = SNAC.from_pretrained(name_or_path).eval().to(device=device, dtype=getattr(torch, dtype))
        model.encoder = None  # only the decoder is used
        return cls(model, device)

    def capture_graphs(self, window_lengths: Sequence[int], max_batch: int) -> None:
        """CUDA-graph these window lengths for batches up to `max_batch`; GPU only (no-op elsewhere)."""
        if not self.device.startswith("cuda"):
            return
        t0 = time.perf_counter()
        # One memory pool for every length, longest first (as for batch sizes within a length): the pool is
        # about the size of the longest window's largest batch, not the sum over lengths. Safe because one graph
        # replays at a time and its output is copied out before the next replay.
        pool = torch.cuda.graph_pool_handle()
        try:
            for frames in sorted(set(window_lengths), reverse=True):
                self._graphed.append(_GraphedDecoder(self.model, self.device, frames, max_batch, pool))
        except Exception:  # timed eagerly then: the benchmarks report `graphed`
            log.exception("SNAC CUDA graph capture failed; decoding eagerly")
            self._graphed.clear()
            return
        log.info("SNAC CUDA graphs for windows of %s frames, batches up to %d, in %.1f s",
                 sorted(set(window_lengths)), max_batch, time.perf_counter() - t0)

    def graphed(self, frames: int, batch: int) -> _GraphedDecoder | None:
        """The captured decoder for this window length and batch, if any."""
        return next((g for g in self._graphed if g.fits(frames, batch)), None)

    def decode_codes(self, codes: np.ndarray, frames: int, *, use_graphs: bool = True) -> np.ndarray:
        """int16 PCM [batch, 2048 * frames] of window rows `codes` ([batch, 7 * frames])."""
        with torch.inference_mode():
            graphed = self.graphed(frames, codes.shape[0]) if use_graphs else None
            if graphed is not None:
                return graphed(codes)
            return _decode_to_pcm(self.model, torch.from_numpy(codes).to(self.device), frames).cpu().numpy()
