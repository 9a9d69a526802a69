"""How the exact streaming step runs on a device: precision and compile choices, the state pool tensor, packed
launches with one host copy each way, and CUDA graphs captured per batch bucket (and per common bridge length) so
that a tick is one replay, not hundreds of kernel launches. `DeviceSteps` is the base of `pool.StreamingSnac`.
Why bfloat16 and torch.compile: docs/decisions/exact-streaming-snac-decoder.md; the rest:
docs/decisions/snac-device-step.md.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from gateway.orpheus import SAMPLES_PER_FRAME, SLOTS_PER_FRAME
from gateway.speech.snac.layers import DecoderLayers
from gateway.speech.snac.state import StreamStats

INT16_MAX = 32767
# Batch sizes with a captured graph: a batch runs in the smallest bucket that holds it (padded rows are wasted
# work, so above 64 the buckets grow by 64, not by doubling).
GRAPH_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512)
# Bridge decodes with a captured graph: their common lengths (a first piece of 1 or 2 frames, a continuing piece of
# one new frame with its context and lookahead: 3) and batch sizes (the streams starting or bridging in one tick).
# Other lengths run eagerly (~175 kernel launches each).
BRIDGE_GRAPH_FRAMES = (1, 2, 3)
BRIDGE_GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# A compiled step is general in the batch size from 2 up: dynamo specializes a dimension of size 1, so a lone row
# is padded to 2 (one scratch row) instead of compiling a third graph.
COMPILED_MIN_BATCH = 2
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# SNAC's precision where `--snac-dtype auto` runs it on a GPU: faster than float32 and close to it (the tests hold
# it above 33 dB SNR); float16 lacks the range of snake's 1 / alpha (docs/decisions/snac-device-step.md).
GPU_SNAC_DTYPE = "bfloat16"


def snac_device_and_dtype(device: str, dtype: str) -> tuple[str, str]:
    """The one reading of `--snac-device auto` (CUDA when there is one) and `--snac-dtype auto` (GPU_SNAC_DTYPE on
    CUDA; float32 elsewhere: CPUs without bfloat16 units run it slower, and CPU tests compare against float32)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = GPU_SNAC_DTYPE if device.startswith("cuda") else "float32"
    return device, dtype


def snac_kernels(device: str, kernels: bool | None) -> bool:
    """The one reading of `--snac-kernels`' default (None): on where they run (CUDA with Triton), where they beat
    the compiled step (docs/decisions/snac-kernels.md); asked for where they cannot run, a ValueError that says
    why."""
    from gateway.speech.snac.kernels import kernels_available

    if kernels is False:  # off by name: Triton is not even imported
        return False
    if not kernels_available(torch.device(device)):
        if kernels:
            raise ValueError(f"--snac-kernels needs CUDA and Triton; SNAC runs on {device}")
        return False
    return True


def snac_compiles(device: str, compile: bool | None) -> bool:
    """The one reading of `--snac-compile`'s default (None): compile on CUDA, where the fused step is faster than
    eager; not on a CPU, where it is no faster and only adds its compile time
    (docs/decisions/exact-streaming-snac-decoder.md)."""
    return device.startswith("cuda") if compile is None else compile


class StepGraph:
    """The streaming step (masked or not) captured as a CUDA graph for one batch size, on static packed inputs.
    Rows beyond the batch are padding: scratch slot, end 0."""

    def __init__(self, run: Any, padding: torch.Tensor, pool: Any, capture: bool = True) -> None:
        """`padding`: [batch, width] rows that touch only the scratch slot (end 0: everything masked). Without
        `capture` (tests on CPU) the same static-input logic runs `run` eagerly."""
        self.batch = padding.shape[0]
        self._padding = padding
        self._run = run
        self.inputs = padding.clone()  # warm-up and capture runs touch the scratch slot only
        self.graph: Any = None
        if not capture:
            return
        device = padding.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(3):  # TorchScript (snake) profiles, then fuses, before the capture
                run(self.inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.audio, self.pcm = run(self.inputs)

    def __call__(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = packed.shape[0]
        self.inputs[:rows].copy_(packed, non_blocking=True)
        if rows < self.batch:
            self.inputs[rows:].copy_(self._padding[rows:])
        if self.graph is None:
            self.audio, self.pcm = self._run(self.inputs)
        else:
            self.graph.replay()
        return self.audio[:rows], self.pcm[:rows]


class DeviceSteps:
    """The device side of `StreamingSnac`: the decoder's tensors, the pool of stream states, the (compiled) step,
    its graphs and the host buffers of its transfers. Not thread-safe: one owner thread."""

    def __init__(self, model: Any, device: str | torch.device = "cpu", dtype: str | torch.dtype = "float32",
                 max_streams: int = 64, chunk_frames: int = 1, compile: bool = False, kernels: bool = False,
                 head_kernels: bool = False) -> None:
        """`model`: a `snac.SNAC` (24 kHz config); its decoder weights are copied, the model is not kept.
        `compile`: the streaming step through torch.compile (docs/decisions/exact-streaming-snac-decoder.md).
        `kernels`: its residual units as fused Triton kernels (`snac.kernels`; docs/decisions/snac-kernels.md);
        `head_kernels`: its block heads too ("Block heads" there)."""
        self.device = torch.device(device)
        self.dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        if chunk_frames < 1 or max_streams < 1:
            raise ValueError("chunk_frames and max_streams must be >= 1")
        self.max_streams = max_streams
        self.chunk_frames = chunk_frames
        self.decoder = DecoderLayers(model, self.device, self.dtype, fusable=compile, kernels=kernels,
                                     head_kernels=head_kernels)
        self.compiled, self.kernels, self.head_kernels = compile, kernels, head_kernels
        # One compile per `masked` value: the batch dimension is marked dynamic (`_run_packed`) and never 1.
        self._stream = (torch.compile(self.decoder.stream, fullgraph=True, dynamic=False) if compile
                        else self.decoder.stream)
        self.delay_samples = self.decoder.delay
        self.chunk_samples = chunk_frames * SAMPLES_PER_FRAME
        # Pool of stream states; row max_streams is the scratch slot of padded batch rows.
        self.pool = torch.zeros((max_streams + 1, self.decoder.state_size), dtype=self.dtype, device=self.device)
        self._codes_width = chunk_frames * SLOTS_PER_FRAME
        self._width = self._codes_width + 4  # codes, slot, first frame, end (frames), seed
        self._graphs: dict[tuple[bool, int], StepGraph] = {}  # (masked, batch) -> graph
        self._bridge_graphs: dict[tuple[int, int], StepGraph] = {}  # (frames, batch) -> graph
        # Per launch of a tick and per bridge length (pinned on CUDA).
        self._host_buffers: dict[tuple[str, int], torch.Tensor] = {}
        # The wait for the GPU (a tick's steps, a bridge decode) is a blocking event: the thread sleeps until the
        # work is done, where a stream sync spins and holds a core (docs/decisions/snac-device-step.md).
        self._device_done = torch.cuda.Event(blocking=True) if self.device.type == "cuda" else None
        self.stats = StreamStats()

    # -- device-level step ---------------------------------------------------------------------------------

    def _run_packed(self, packed: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on packed rows [B, 7k + 4] (codes, slot, first frame, end, seed), all on the device: gather
        the states, advance, scatter them back; float32 audio and int16 PCM [B, 2048 k]."""
        rows = packed.shape[0]
        if self.compiled and rows < COMPILED_MIN_BATCH:
            padded = torch.cat([packed, self._padding_rows(COMPILED_MIN_BATCH - rows)])
            audio, pcm = self._run_packed(padded, masked)
            return audio[:rows], pcm[:rows]
        w = self._codes_width
        slots = packed[:, w]
        codes = packed[:, :w].reshape(-1, self.chunk_frames, SLOTS_PER_FRAME)
        inputs = (self.pool.index_select(0, slots), codes, packed[:, w + 1], packed[:, w + 2], packed[:, w + 3])
        if self.compiled:
            for tensor in inputs:
                torch._dynamo.mark_dynamic(tensor, 0)
        audio, new_state = self._stream(*inputs, masked)
        self.pool.index_copy_(0, slots, new_state)
        audio = audio.float()
        return audio, (audio.clamp(-1.0, 1.0) * INT16_MAX).to(torch.int16)

    def _run_bridge(self, packed: torch.Tensor, frames: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A bridge decode on packed rows [B, 7 frames + 2] (codes, first frame, seed): float32 audio
        [B, 2048 frames] (twice: a graph's outputs are a pair)."""
        w = frames * SLOTS_PER_FRAME
        codes = packed[:, :w].reshape(-1, frames, SLOTS_PER_FRAME)
        audio = self.decoder.full(codes, packed[:, w], packed[:, w + 1]).float()
        return audio, audio

    def capture_graphs(self, max_batch: int | None = None, buckets: Sequence[int] = GRAPH_BATCH_BUCKETS, *,
                       emulate: bool = False) -> None:
        """CUDA-graph the step, masked and unmasked, for the batch `buckets` up to `max_batch` (default:
        min(max_streams, 512)), and the bridge's common decodes (`BRIDGE_GRAPH_FRAMES` x `BRIDGE_GRAPH_BUCKETS`);
        GPU only (no-op elsewhere). All graphs share one memory pool (captured largest
        first): their outputs are valid until the next launch. `emulate` (tests, any device) sets up the same
        buckets, static inputs and padded rows but runs them eagerly instead of capturing."""
        cuda = self.device.type == "cuda"
        if not (cuda or emulate):
            return
        top = min(max_batch or 512, self.max_streams)
        smallest = COMPILED_MIN_BATCH if self.compiled else 1
        sizes = sorted({max(b, smallest) for b in buckets if b < top} | {max(top, smallest)})
        pool = torch.cuda.graph_pool_handle() if cuda and not emulate else None
        with torch.inference_mode():
            for size in reversed(sizes):
                for masked in (True, False):
                    run = functools.partial(self._run_packed, masked=masked)
                    padding = self._padding_rows(size)
                    self._graphs[masked, size] = StepGraph(run, padding, pool, capture=pool is not None)
            for frames in BRIDGE_GRAPH_FRAMES:
                for size in reversed([b for b in BRIDGE_GRAPH_BUCKETS if b <= top]):
                    run = functools.partial(self._run_bridge, frames=frames)
                    padding = torch.zeros((size, frames * SLOTS_PER_FRAME + 2), dtype=torch.int64,
                                          device=self.device)
                    self._bridge_graphs[frames, size] = StepGraph(run, padding, pool, capture=pool is not None)

    def precompile(self) -> None:
        """With `compile` (or `kernels`), compile both step graphs (or the kernels) now, a padded step on the
        scratch slot each, instead of in the first utterance's tick (minutes on a small CPU) or inside a graph
        capture, so a compiler that cannot work fails at start-up (`load` calls it). A no-op once graphs are set
        up: their capture compiled them."""
        if not (self.compiled or self.kernels or self.head_kernels) or self._graphs:
            return
        with torch.inference_mode():
            for masked in (True, False):
                self._run_packed(self._padding_rows(COMPILED_MIN_BATCH), masked)

    def _padding_rows(self, rows: int) -> torch.Tensor:
        padding = torch.zeros((rows, self._width), dtype=torch.int64, device=self.device)
        padding[:, self._codes_width] = self.max_streams
        return padding

    def step(self, slots: torch.Tensor, codes: torch.Tensor, positions: torch.Tensor, ends: torch.Tensor,
             seeds: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Device-level step of B streams (no host sync): `slots` [B] pool rows, `codes` [B, k, 7] the next
        chunk of each stream, `positions` [B] the chunk's first frame, `ends` [B] each stream's length in
        frames (OPEN_END while open; steps past the end flush), `seeds` [B]. `masked=False` skips the edge
        masks: exact only for rows where `needs_mask` is false. Returns float32 audio and int16 PCM [B, 2048 k] of
        samples [2048 * position - delay_samples, ... + 2048 k) (CUDA-graph outputs: valid until the next
        launch)."""
        packed = torch.cat([codes.reshape(codes.shape[0], -1), slots[:, None], positions[:, None], ends[:, None],
                            seeds[:, None]], dim=1).to(device=self.device, dtype=torch.int64)
        return self._launch(packed, masked)

    def _launch(self, packed: torch.Tensor, masked: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        rows = packed.shape[0]
        self.stats.launches += 1
        with torch.inference_mode():
            bucket = next((b for m, b in sorted(self._graphs) if m == masked and b >= rows), None)
            if bucket is None:
                return self._run_packed(packed, masked)
            self.stats.padded_rows += bucket - rows
            return self._graphs[masked, bucket](packed)

    def _max_rows(self) -> int:
        return max(b for _, b in self._graphs) if self._graphs else self.max_streams

    def _to_device(self, rows: np.ndarray, part: int) -> torch.Tensor:
        """The tick's `part`-th launch's packed rows on the device: through its own pinned staging buffer, whose
        previous copy ended with the last tick's sync."""
        if self.device.type != "cuda":
            return torch.from_numpy(rows).to(self.device)
        staging = self._host_buffer(("in", part), (self._max_rows(), self._width), torch.int64,
                                    pinned=True)[:rows.shape[0]]
        staging.numpy()[:] = rows
        return staging.to(self.device, non_blocking=True)

    def _to_host(self, result: torch.Tensor, key: tuple[str, int], capacity: int = 0) -> np.ndarray:
        """A launch's output in the host buffer `key` names (of at least `capacity` rows), which every later launch
        of its kind reuses (on every device, so the CPU tests see the reuse the GPU has): on CUDA a pinned buffer
        and an asynchronous copy, valid after `_wait_for_device`."""
        cuda = self.device.type == "cuda"
        host = self._host_buffer(key, (max(capacity, result.shape[0]), result.shape[1]), result.dtype,
                                 pinned=cuda)[:result.shape[0]]
        host.copy_(result, non_blocking=cuda)
        return host.numpy()

    def _wait_for_device(self) -> None:
        """Until the device has done what was launched (on CUDA: on a blocking event, `_device_done`)."""
        if self._device_done is not None:
            self._device_done.record(torch.cuda.current_stream(self.device))
            self._device_done.synchronize()

    def _host_buffer(self, key: tuple[str, int], shape: tuple[int, int], dtype: torch.dtype,
                     pinned: bool) -> torch.Tensor:
        buffer = self._host_buffers.get(key)
        if buffer is None or buffer.dtype != dtype or buffer.shape[0] < shape[0] or buffer.shape[1] != shape[1]:
            buffer = torch.empty(shape, dtype=dtype)
            buffer = self._host_buffers[key] = buffer.pin_memory() if pinned else buffer
        return buffer
