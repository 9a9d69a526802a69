"""What the synthesizer needs of a streaming SNAC decoder (`Decoder`), met by the decoder in this process
(`stream_decoder.StreamDecoder`) and by a client of the shared SNAC process (`codec.client.CodecStreamClient`), and
the settings a decoder is loaded from (`DecoderSettings`, `load_stream_decoder`). Torch loads only with a decoder.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.orpheus import Frame
from gateway.speech.step_timing import step_duty_on
from gateway.speech.stream_decoder import DecodeStats, DecodeStream, StreamDecoder


class Decoder(Protocol):
    """A streaming SNAC decoder serving a process's sentences: `open` a stream per sentence, `push` its frames as
    they come, `finish` it, `release` it when the sentence is over; its audio arrives in `DecodeStream.chunks`.
    Never blocks the event loop. `on_batch` and `on_first_audio` are the metrics hooks, `stats` the counters
    (idle where the decoding runs elsewhere)."""

    on_batch: Callable[[int, float, int, int], None] | None
    on_first_audio: Callable[[bool, float, float | None], None] | None
    stats: DecodeStats

    def open(self, lead_s: Callable[[], float], lookahead: int = ..., *,
             lead_runs: Callable[[], bool] = ...) -> DecodeStream: ...

    def push(self, stream: DecodeStream, frames: Sequence[Frame]) -> None: ...

    def finish(self, stream: DecodeStream) -> None: ...

    def release(self, stream: DecodeStream) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class DecoderSettings:
    """What a SNAC stream decoder needs, made from the gateway's config by `synthesizer.decoder_settings`: a
    gateway process loads its own decoder from it, the shared SNAC process its one for every worker."""

    snac_model: str
    device: str = "auto"
    snac_dtype: str = "auto"
    cuda_graphs: bool = True
    max_batch: int = 256  # streams per step
    max_streams: int = 512  # stream slots, for the sentences of all workers together
    compile: bool | None = None  # the step through torch.compile (the gateway's snac_compile; None: on a GPU)
    kernels: bool | None = None  # residual units as fused kernels (the gateway's snac_kernels; None: where they run)
    step_duty: float | None = None  # the most of the wall time steps take (the gateway's snac_step_duty; None: by
    # where SNAC runs, `step_duty_on`)


def load_stream_decoder(settings: DecoderSettings) -> StreamDecoder:
    """The exact streaming decoder as the settings say: served, or in a gateway process."""
    from gateway.speech.snac import StreamingSnac  # torch: only in the process that decodes

    snac = StreamingSnac.load(settings.snac_model, settings.device, settings.snac_dtype,
                              max_streams=settings.max_streams, capture_graphs=settings.cuda_graphs,
                              max_batch=settings.max_batch, compile=settings.compile, kernels=settings.kernels)
    return StreamDecoder(snac, settings.max_batch, step_duty=step_duty_on(snac.device.type, settings.step_duty))
