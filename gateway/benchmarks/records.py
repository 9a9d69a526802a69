"""Per-request records and the per-point summary both levels share.

A request is one phrase spoken by one user. Its audio is a list of arrivals `(seconds after the request was
sent, seconds of audio)`: SNAC chunks at the engine level, received 20 ms audible frames at the WebRTC level.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from gateway.benchmarks.corpus import Phrase
from gateway.benchmarks.timing import describe, gaps, simulate_playback

MS = 1000.0
# Stalls whose first late chunk arrived in the same window of the point's clock fall at one "moment": many streams
# stalling at a few moments, in every client process, is the host (a burst's CPU), not the streams
# (docs/decisions/benchmark-clients.md).
STALL_MOMENT_S = 0.1


@dataclass(frozen=True)
class PlannedRequest:
    user: int
    index: int  # position in the user's sequence of phrases
    phrase: Phrase
    voice: str | None = None  # None: the gateway's default voice

    @property
    def request_id(self) -> str:
        return f"u{self.user}-p{self.index}"


@dataclass
class RequestRecord:
    user: int
    index: int
    lang: str
    size: str
    chars: int
    sent_at_s: float  # when it was sent, after the point started
    voice: str | None = None  # the voice asked for (None: the default)
    boundaries: int | None = None  # engine levels, mixed-language text: sentences starting a span of another voice
    ok: bool = False
    error: str | None = None
    ttft_ms: float | None = None  # engine level only
    ttff_ms: float | None = None  # engine level only
    ttfw_ms: float | None = None  # engine level only: the first decode window went to SNAC
    generated_ms: float | None = None  # engine level only: the last token (generation done)
    ttfa_ms: float | None = None
    done_ms: float | None = None  # last audio (engine) or the `done` event (WebRTC), after sending
    audio_s: float = 0.0
    tokens: int | None = None
    chunks: int = 0
    rtf: float | None = None  # done / audio of this stream
    max_gap_ms: float | None = None
    gap_p95_ms: float | None = None
    playback: dict[str, dict[str, Any]] = field(default_factory=dict)  # by client buffer (ms)
    server: dict[str, Any] | None = None  # WebRTC: the server's `started`/`done` figures
    endings: int | None = None  # WebRTC: terminal events received for it (exactly one is right)
    delivery_jitter_ms: float | None = None  # WebRTC: how far frame arrivals strayed from the sender's RTP clock
    arrivals: list[tuple[float, float]] | None = None  # kept only with --keep-arrivals (ms, ms)
    frames_at_ms: list[float] | None = None  # engine levels, with --keep-arrivals: the first frames' arrival
    client_process: int | None = None  # WebRTC with --client-processes: which client process played it

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_record(request: PlannedRequest, sent_at_s: float) -> RequestRecord:
    phrase = request.phrase
    return RequestRecord(user=request.user, index=request.index, lang=phrase.lang, size=phrase.size,
                         chars=phrase.chars, sent_at_s=round(sent_at_s, 4), voice=request.voice)


def apply_arrivals(record: RequestRecord, arrivals: Sequence[tuple[float, float]], buffers_ms: Sequence[int],
                   tolerance_ms: float, keep: bool, held_ms: int = 0,
                   boundary_chunks: Collection[int] | None = None) -> None:
    """Fill the audio figures of `record` from its arrivals (seconds after sending, seconds of audio). The stall
    view of buffer b is a listener holding b ms in all, of which `held_ms` were held before these arrivals (the
    server's jitter buffer, for frames received over WebRTC): the arrivals are played with b - held_ms more.
    `boundary_chunks`: the indexes of the arrivals that begin a span of another voice (mixed-language text); each
    view then counts the stalls that waited for one (`boundary_stalls`)."""
    record.chunks = len(arrivals)
    record.audio_s = round(sum(d for _, d in arrivals), 4)
    if arrivals:
        record.ttfa_ms = round(arrivals[0][0] * MS, 2)
        between = describe(gaps([t for t, _ in arrivals]), MS)
        record.max_gap_ms = between["max"]
        record.gap_p95_ms = between["p95"]
    for buffer_ms in buffers_ms:
        played = simulate_playback(arrivals, (buffer_ms - held_ms) / MS, tolerance_ms / MS)
        record.playback[str(buffer_ms)] = {
            "stalled": played.stalled, "stalls": played.stalls, "stall_ms": round(played.stall_s * MS, 2),
            "max_late_ms": round(played.max_late_s * MS, 2)}
        if played.first_stall_at_s is not None:  # after sending, as the arrivals
            record.playback[str(buffer_ms)]["first_stall_ms"] = round(played.first_stall_at_s * MS, 2)
        if boundary_chunks is not None:
            record.playback[str(buffer_ms)]["boundary_stalls"] = len(set(played.stalled_chunks) & set(boundary_chunks))
    if record.done_ms is not None and record.audio_s > 0:
        record.rtf = round(record.done_ms / MS / record.audio_s, 4)
    if keep:
        record.arrivals = [(round(t * MS, 2), round(d * MS, 2)) for t, d in arrivals]
    else:
        record.frames_at_ms = None


def count_server_underruns(record: RequestRecord, listener_buffer_ms: int = 0) -> None:
    """WebRTC: in the view of the server's own buffer (`listener_buffer_ms`, what the peers asked for; the client
    adds nothing) a server underrun is a stall, whether or not the client's frame times show it: the server's view
    is the listener's, and the silence it sent is in the stream; but Opus' spill makes a one-frame underrun read as
    audio at the client (the benchmarks' README, WebRTC frame accounting), which hid most of them
    (docs/decisions/benchmark-clients.md). Larger views keep the client's figures:
    their client-side buffer absorbs the lateness."""
    played = record.playback.get(str(listener_buffer_ms))
    server = record.server or {}
    underruns = server.get("underruns") or 0
    if played is None or not underruns:
        return
    played["server_underruns"] = underruns
    if not played["stalled"]:
        played.update(stalled=True, stalls=underruns, stall_ms=server.get("underrun_ms") or 0)


def summarize(records: Sequence[RequestRecord], users: int, buffers_ms: Sequence[int]) -> dict[str, Any]:
    """The per-point figures the tables and plots show (definitions in gateway/benchmarks/README.md)."""
    ok = [r for r in records if r.ok]
    ends = [r.sent_at_s + r.done_ms / MS for r in ok if r.done_ms is not None]
    wall_s = max(ends) - min(r.sent_at_s for r in records) if ends else None
    audio_s = sum(r.audio_s for r in ok)
    summary: dict[str, Any] = {
        "users": users,
        "requests": len(records),
        "ok": len(ok),
        "success_rate": round(len(ok) / len(records), 4) if records else None,
        "wall_s": _round(wall_s),
        "audio_s": round(audio_s, 3),
        "rtf": _round(wall_s / audio_s if wall_s and audio_s else None),
        "realtime_users": _round(audio_s / wall_s if wall_s and audio_s else None),
        "ttft_ms": describe([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "ttff_ms": describe([r.ttff_ms for r in ok if r.ttff_ms is not None]),
        "ttfw_ms": describe([r.ttfw_ms for r in ok if r.ttfw_ms is not None]),
        "ttfa_ms": describe([r.ttfa_ms for r in ok if r.ttfa_ms is not None]),
        "generated_ms": describe([r.generated_ms for r in ok if r.generated_ms is not None]),
        "stream_rtf": describe([r.rtf for r in ok if r.rtf is not None]),
        "max_gap_ms": max((r.max_gap_ms for r in ok if r.max_gap_ms is not None), default=None),
        "delivery_jitter_ms": describe([r.delivery_jitter_ms for r in ok if r.delivery_jitter_ms is not None]),
        "playback": {str(b): _playback_summary(records, str(b)) for b in buffers_ms},
        "errors": sorted({r.error for r in records if r.error}),
    }
    audited = [r for r in records if r.endings is not None]
    if audited:  # WebRTC: the exactly-once audit of every utterance's ending
        summary["endings"] = {"audited": len(audited), "missing": sum(1 for r in audited if r.endings == 0),
                              "doubled": sum(1 for r in audited if r.endings > 1),
                              "out_of_order": sum(1 for r in audited if r.error == "events_out_of_order")}
    servers = [r.server for r in ok if r.server]
    if servers:
        summary["server"] = _server_summary(servers)
    if any(r.voice for r in records):
        summary["by_voice"] = by_voice(records, buffers_ms)
    spanned = [r for r in records if r.boundaries is not None]
    if spanned:
        summary["span_boundaries"] = {
            "boundaries": sum(r.boundaries or 0 for r in spanned),
            "underruns": {str(b): sum(r.playback[str(b)].get("boundary_stalls", 0) for r in spanned if r.ok)
                          for b in buffers_ms},
            "streams_with_boundary_underruns": {
                str(b): sum(1 for r in spanned if r.ok and r.playback[str(b)].get("boundary_stalls", 0) > 0)
                for b in buffers_ms}}
    return summary


def by_voice(records: Sequence[RequestRecord], buffers_ms: Sequence[int]) -> dict[str, dict[str, Any]]:
    """Per voice asked for (a voice names its model, or its LoRA adapter): streams, audio, and the streams that
    played without a stall in each view (`realtime_streams`)."""
    voices: dict[str, list[RequestRecord]] = {}
    for r in records:
        voices.setdefault(r.voice or "", []).append(r)
    return {voice: {
        "streams": len(group), "ok": sum(1 for r in group if r.ok),
        "audio_s": round(sum(r.audio_s for r in group if r.ok), 3),
        "realtime_streams": {str(b): sum(1 for r in group if r.ok and not r.playback[str(b)]["stalled"])
                             for b in buffers_ms}}
        for voice, group in voices.items()}


def _playback_summary(records: Sequence[RequestRecord], buffer_key: str) -> dict[str, Any]:
    """Streams that stalled, and users whose every stream played without a stall (real-time users)."""
    stalled_users = {r.user for r in records if not r.ok or r.playback[buffer_key]["stalled"]}
    users = {r.user for r in records}
    played = [r.playback[buffer_key] for r in records if r.ok]
    # Where the client-seen stalls fell: moments of the point's clock, and client processes (a server underrun
    # counted as a stall has no client-seen position).
    seen = [r for r in records if r.ok and "first_stall_ms" in r.playback[buffer_key]]
    moments = {int((r.sent_at_s + r.playback[buffer_key]["first_stall_ms"] / MS) // STALL_MOMENT_S) for r in seen}
    processes = {r.client_process for r in seen if r.client_process is not None}
    return {
        "streams_stalled": sum(1 for r in records if not r.ok or r.playback[buffer_key]["stalled"]),
        "realtime_users": len(users - stalled_users),
        "stall_ms_max": max((p["stall_ms"] for p in played), default=None),
        "max_late_ms": max((p["max_late_ms"] for p in played), default=None),
        "stall_moments": len(moments),
        "stalled_client_processes": len(processes) if any(r.client_process is not None for r in records) else None,
    }


def _server_summary(servers: Sequence[dict[str, Any]]) -> dict[str, Any]:
    return {
        **{key: describe([s[key] for s in servers if s.get(key) is not None])
           for key in ("ttft_ms", "ttfw_ms", "ttfa_ms")},
        "audio_s": round(sum(s.get("audio_ms", 0) for s in servers) / MS, 3),
        "underruns": sum(s.get("underruns", 0) for s in servers),
        "underrun_ms": sum(s.get("underrun_ms", 0) for s in servers),
        "streams_with_underruns": sum(1 for s in servers if s.get("underruns", 0) > 0),
        # frames the server's playout handed over > 10 ms after their slot: its share of the delivery jitter
        "late_frames": sum(s.get("late_frames") or 0 for s in servers),
        "streams_with_late_frames": sum(1 for s in servers if (s.get("late_frames") or 0) > 0),
        "max_late_ms": max((s["max_late_ms"] for s in servers if s.get("max_late_ms") is not None), default=None),
        "underruns_where": underruns_where(servers),
    }


def underruns_where(servers: Sequence[dict[str, Any]]) -> dict[str, int]:
    """Where the server's underruns began in their utterances (`done.underrun_at_ms`): in the first second (the
    fast start's hand-over), in the last 100 ms (waiting for the end: its last frames or the end itself), or
    between (a sentence join, or synthesis slower than real time)."""
    where = {"first_second": 0, "middle": 0, "last_100_ms": 0}
    for s in servers:
        audio_ms = s.get("audio_ms") or 0
        for at in s.get("underrun_at_ms") or ():
            key = "last_100_ms" if at >= audio_ms - 100 else "first_second" if at < 1000 else "middle"
            where[key] += 1
    return where


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def first_audio_starts(first_audios: float, hold_s: float, paced: float, pace_s: float) -> dict[str, Any]:
    """A point's first audios (in this process or, from its /metrics, in a gateway elsewhere): how many, their mean
    hold from the head ready to the audio, and the mean generation pace they were planned at (ms per frame)."""
    return {"first_audios": int(first_audios),
            "start_hold_ms": round(hold_s / first_audios * MS, 1) if first_audios else None,
            "start_pace_ms": round(pace_s / paced * MS, 1) if paced else None}
