"""Benchmarks: the measurement arithmetic on its own, and a smoke run of both levels on the shared tiny engine."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from gateway.benchmarks import fast_start
from gateway.benchmarks.corpus import SIZES, mixed
from gateway.benchmarks.engine_level import START_FRAMES
from gateway.benchmarks.report import markdown_table
from gateway.benchmarks.run import run_scenarios
from gateway.benchmarks.scenarios import lora_voices, span_language, traffic_voices
from gateway.benchmarks.settings import parse_options, positive_int_list
from gateway.benchmarks.timing import describe, simulate_playback, token_budget
from gateway.benchmarks.webrtc_level import audio_frames, delivery_jitter_ms
from gateway.config import GatewayConfig
from gateway.devtools.client import OPUS_RATE, ReceivedFrame
from gateway.speech.synthesizer import Synthesizer
from tests.support import BENCH_MODEL_ARGS, bench_models_config, running

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOUD, TAIL, QUIET = 3000.0, 25.0, 0.0


# --- arithmetic (no engine) --------------------------------------------------------------------------

def test_playback_stalls_only_when_a_chunk_misses_its_playout_time() -> None:
    arrivals = [(0.0, 0.1), (0.05, 0.1), (0.35, 0.1), (0.36, 0.1)]  # third chunk 150 ms late without buffer
    no_buffer = simulate_playback(arrivals, 0.0)
    assert no_buffer.stalls == 1 and no_buffer.stall_s == pytest.approx(0.15)
    assert no_buffer.max_late_s == pytest.approx(0.15)
    assert no_buffer.first_stall_at_s == pytest.approx(0.35)
    assert not simulate_playback(arrivals, 0.5).stalled
    assert not simulate_playback(arrivals, 0.0, tolerance_s=0.2).stalled
    assert simulate_playback([], 0.0).stalls == 0


def test_token_budget_is_whole_frames_within_the_cap() -> None:
    assert token_budget(70, 6.0, 2400) == 420
    assert token_budget(1, 1.0, 2400) == 7
    assert token_budget(10_000, 6.0, 140) == 140
    assert token_budget(70, 0.0, 2400) is None


def test_describe_and_mix_are_reproducible() -> None:
    stats = describe([1.0, 2.0, 3.0], scale=1000)
    assert stats["min"] == 1000 and stats["max"] == 3000 and stats["p50"] == 2000
    assert describe([])["max"] is None
    assert mixed(20, seed=1) == mixed(20, seed=1)
    assert {p.size for p in mixed(50, seed=1)} == set(SIZES)


def test_audio_frames_undo_opus_spill_and_tail() -> None:
    """Two server runs of 4 frames arrive as 5 loud frames + a faint tail each (measured on loopback)."""
    run = [LOUD] * 5 + [TAIL] + [QUIET] * 3
    frames = [ReceivedFrame(at=i * 0.02, samples=960, rms=rms) for i, rms in enumerate(run * 2)]
    assert len(audio_frames(frames)) == 8


def test_delivery_jitter_is_the_spread_of_arrivals_against_the_rtp_clock() -> None:
    """Frames on the sender's clock have none, whatever the constant delay and across the RTP timestamp's wrap; one
    frame 30 ms late, then the rest on time again, has 30 ms; frames without a timestamp do not count."""
    step = OPUS_RATE // 50  # a 20 ms frame

    def frames(start: int, late_s: dict[int, float]) -> list[ReceivedFrame]:
        return [ReceivedFrame(at=5.0 + i * 0.02 + late_s.get(i, 0.0), samples=960, rms=LOUD,
                              rtp_timestamp=(start + i * step) % 2 ** 32) for i in range(20)]

    assert delivery_jitter_ms(frames(1000, {})) == pytest.approx(0.0, abs=1e-6)
    assert delivery_jitter_ms(frames(2 ** 32 - 3 * step, {})) == pytest.approx(0.0, abs=1e-6)
    assert delivery_jitter_ms(frames(1000, {7: 0.03})) == pytest.approx(30.0)
    unstamped = [ReceivedFrame(at=i * 0.5, samples=960, rms=LOUD) for i in range(5)]
    assert delivery_jitter_ms(unstamped) is None
    assert delivery_jitter_ms(frames(1000, {})[:1]) is None


def test_table_leaves_out_empty_columns() -> None:
    summary: dict[str, Any] = {"users": 2, "requests": 2, "success_rate": 1.0, "ttfa_ms": {"min": 5.0},
                               "ttft_ms": {}, "ttff_ms": {}, "playback": {}}
    table = markdown_table("ttfa", "webrtc", [{"summary": summary}], [0])
    assert "TTFA min ms" in table and "TTFT" not in table


# --- smoke run on the shared engine ------------------------------------------------------------------

SMOKE_ARGS = ["--scenario", "stress,streaming", "--level", "vllm,engine,webrtc", "--stress-concurrency", "2",
              "--streaming-users", "2", "--warmup", "0", "--cooldown-s", "0", "--tokens-per-char", "1",
              "--keep-arrivals"]


def _check_point(point: dict[str, Any], level: str, users: int = 2) -> None:
    summary = point["summary"]
    assert summary["ok"] == summary["requests"] == point["users"] == users, summary["errors"]
    assert summary["audio_s"] > 0 and summary["wall_s"] > 0
    assert summary["ttfa_ms"]["min"] > 0
    assert set(summary["playback"]) == {"0", "500"}
    for request in point["requests"]:
        assert request["audio_s"] > 0 and request["ttfa_ms"] > 0
        # Gaps need two chunks: a short phrase the exact decoder finishes before its first chunk comes as one.
        assert request["max_gap_ms"] is not None or request["chunks"] == 1
        assert set(request["playback"]) == {"0", "500"}
        if level in ("engine", "vllm"):
            assert 0 < request["ttft_ms"] <= request["ttfa_ms"]
            # every user asks at the point's start: the time to first token counts the wait behind the others
            assert request["index"] > 0 or request["sent_at_s"] == 0.0
            frames_at = request["frames_at_ms"]  # each of the first frames once, when it was whole
            assert len(frames_at) == min(START_FRAMES, request["tokens"] // 7)
            assert frames_at == sorted(frames_at) and frames_at[0] == request["ttff_ms"]
            assert request["tokens"] >= 7 * request["chunks"] if level == "vllm" else request["tokens"] > 0
        else:
            assert request["server"]["audio_ms"] > 0 and request["server"]["underruns"] is not None
            server = request["server"]
            assert 0 < server["ttft_ms"] <= server["ttfw_ms"] <= server["ttfa_ms"], server
            assert request["delivery_jitter_ms"] >= 0  # every frame carried its RTP timestamp
            assert server["late_frames"] >= 0 and server["max_late_ms"] >= 0
    assert point["pipeline"]["wall_s"] > 0
    if level == "engine":  # the decoder's time in bridge decodes, beside its steps', its exact starts, its wake-ups
        snac = point["pipeline"]["snac"]
        assert (snac["bridge_busy_s"] > 0) == (snac["bridge_frames"] > 0)
        # each sentence starts from the bridge or (at a slow pace, as this CPU's) from the exact stream
        assert snac["bridge_frames"] > 0 or snac["exact_starts"] > 0
        assert snac["worker_wakeups_per_s"] > 0
        # every request's first sentence started, with its hold from the head in counted
        assert snac["first_audios"] >= users and snac["start_hold_ms"] is not None and snac["start_hold_ms"] >= 0


def _png_signature(path: str) -> bytes:
    return Path(path).read_bytes()[:len(PNG_SIGNATURE)]


@pytest.mark.engine
async def test_bench_smoke_both_levels(synthesizer: Synthesizer, test_config: GatewayConfig,
                                       tmp_path: Path) -> None:
    options = parse_options([*SMOKE_ARGS, "--out", str(tmp_path)])
    run = await run_scenarios(synthesizer, test_config, options, SMOKE_ARGS)

    saved = json.loads((tmp_path / "bench.json").read_text())
    plots = {(s["scenario"], s["level"]): _png_signature(s["plot"]) for s in saved["scenarios"]}
    assert saved["schema"] == run["schema"] and saved["machine"]["cpu_cores_logical"] >= 1
    assert saved["model"]["shape"]["vocab_size"] == 156_940
    assert saved["engine"]["model"] == test_config.model
    assert saved["decoder"] == {"step_duty": 1.0}, "the step duty the default resolved to (SNAC on this CPU)"
    assert [(s["scenario"], s["level"]) for s in saved["scenarios"]] == [
        ("stress", "vllm"), ("streaming", "vllm"), ("stress", "engine"), ("streaming", "engine"),
        ("stress", "webrtc"), ("streaming", "webrtc")]
    assert set(plots.values()) == {PNG_SIGNATURE}
    for scenario in saved["scenarios"]:
        for point in scenario["points"]:
            _check_point(point, scenario["level"])


@pytest.mark.engine
async def test_webrtc_level_with_client_processes(synthesizer: Synthesizer, test_config: GatewayConfig,
                                                  tmp_path: Path) -> None:
    """Peers in two spawned processes: every user's audio arrives, and their CPU is not counted as the gateway's."""
    args = ["--quick", "--scenario", "streaming", "--streaming-users", "3", "--level", "webrtc",
            "--client-processes", "2", "--no-plots", "--warmup", "0", "--out", str(tmp_path)]
    run = await run_scenarios(synthesizer, test_config, parse_options(args), args)

    (point,) = run["scenarios"][0]["points"]
    assert sorted(r["user"] for r in point["requests"]) == [0, 1, 2]
    _check_point(point, "webrtc", users=3)
    assert point["pipeline"]["cpu_s"]["client_processes"] > 0
    host = point["pipeline"]["host"]  # the machine's busy cores include the clients' own
    assert host["cores"] >= 1 and host["busy_cores"] >= host["client_cores"] > 0


def test_opus_cpu_bench_writes_both_paths(tmp_path: Path) -> None:
    from gateway.benchmarks.opus_cpu import main

    out = tmp_path / "opus.json"
    assert main(["--frames", "20", "--peers", "2", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["content"], r["path"].split(",")[0]) for r in rows] == [
        ("speech", "aiortc"), ("speech", "gateway"), ("silence", "aiortc"), ("silence", "gateway")]
    assert all(r["cpu_ms_per_frame"] >= 0 for r in rows)


def test_client_cpu_bench_receives_every_frame_with_both_receivers(tmp_path: Path) -> None:
    """benchmarks.client_cpu: both receivers get the paced stream (every frame the sender sent in the window, by the
    RTP clock, however slowly this machine sent them; at most 50 frames a second a peer and a catch-up) and their
    CPU counted."""
    from gateway.benchmarks.client_cpu import RECEIVERS, main

    out = tmp_path / "client.json"
    assert main(["--peers", "2", "--seconds", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["receiver"] for r in rows] == list(RECEIVERS)
    for row in rows:
        assert row["frames"] > 0 and row["frames_lost"] == 0, row
        assert row["frames_per_s"] <= 2 * 50 * 1.5, row  # each frame counted once (a late sender only slows it)
        assert row["cpu_us_per_frame"] > 0


def test_fast_start_bench_times_the_bridge_against_the_first_chunk_alone(tmp_path: Path) -> None:
    """benchmarks.fast_start runs the real stream decoder in model time: the bridge hands out audio past the first
    frame before the exact stream takes over; without it, the exact stream takes over after one frame."""
    out = tmp_path / "fast_start.json"
    assert fast_start.main(["--paces", "3", "--frames", "12", "--dilation", "4", "--policies", "bridge-la1,first-only",
                            "--out", str(out)]) == 0
    runs = {run["policy"]: run for run in json.loads(out.read_text())["runs"]}
    assert runs["first-only"]["handover_ms"] == pytest.approx(85.3, abs=0.1)
    assert runs["bridge-la1"]["handover_ms"] > runs["first-only"]["handover_ms"]
    assert all(run["frames_at_first_audio"] >= 2 and run["exact_frames_per_frame"] > 1 for run in runs.values())


def test_decoder_schedule_decodes_every_stream_whole_with_and_without_the_hold(tmp_path: Path) -> None:
    """benchmarks.decoder_schedule (CPU smoke): paced streams through the gateway's StreamDecoder, stepping per frame
    and with the hold, at two due leads, the audio reaching its listener 30 ms late; every sentence's audio comes
    out whole each time."""
    from gateway.benchmarks import decoder_schedule

    out = tmp_path / "schedule.json"
    assert decoder_schedule.main(["--streams", "2", "--frames", "6", "--listener-ms", "500", "--holds", "0,0.05",
                                  "--due-ms", "50,200", "--delivery-ms", "30", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["hold_ms"], r["due_ms"], r["delivery_ms"]) for r in runs] == [
        (0, 50, 30), (0, 200, 30), (50, 50, 30), (50, 200, 30)]
    assert all(r["audio_complete"] and r["steps"] >= 6 for r in runs)  # a step advances a stream by one frame
    assert all(r["bridge_frames_per_frame"] > 0 for r in runs)  # every first audio is a bridge's


def test_decoder_schedule_compares_the_start_policies(tmp_path: Path) -> None:
    """benchmarks.decoder_schedule --starts: at real-time pace, listeners without a buffer start from the exact stream
    (no bridge decode) under `exact-or-bridge`, from the bridge under `bridge-held`; both come out whole."""
    from gateway.benchmarks import decoder_schedule

    out = tmp_path / "starts.json"
    assert decoder_schedule.main(["--streams", "2", "--frames", "6", "--pace", "1.0", "--listener-ms", "0",
                                  "--holds", "0.05", "--starts", "exact-or-bridge,bridge-held", "--out", str(out)]) == 0
    runs = {r["start"]: r for r in json.loads(out.read_text())["runs"]}
    assert runs["exact-or-bridge"]["exact_starts"] == 2 and runs["exact-or-bridge"]["bridge_frames_per_frame"] == 0
    assert runs["bridge-held"]["exact_starts"] == 0 and runs["bridge-held"]["bridge_frames_per_frame"] > 0
    assert all(r["audio_complete"] for r in runs.values())


def test_decoder_schedule_runs_the_same_load_in_process_and_behind_the_codec_server(tmp_path: Path) -> None:
    """benchmarks.decoder_schedule --decoders: the same paced streams through the decoder in this process and through a
    StreamCodecServer on a socket; both come out whole, and each row has the decoder's own view of the starts
    (a hold from the head in, and the pace planned at: real time here, 85 ms a frame, loosely on a busy CPU)."""
    from gateway.benchmarks import decoder_schedule

    out = tmp_path / "where.json"
    assert decoder_schedule.main(["--streams", "2", "--frames", "6", "--pace", "1.0", "--listener-ms", "0",
                                  "--holds", "0.05", "--decoders", "in-process,remote", "--out", str(out)]) == 0
    runs = {r["decoder"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"in-process", "remote"}
    for run in runs.values():
        assert run["audio_complete"] and run["exact_starts"] == 2
        assert run["start_hold_ms"] > 0 and 40 < run["start_pace_ms"] < 400
    with pytest.raises(SystemExit):
        decoder_schedule.main(["--decoders", "elsewhere"])


def test_snac_work_counts_what_each_decoder_moves(tmp_path: Path) -> None:
    """benchmarks.snac_work (eager variants): a window moves ~2.5x the bytes of a stream step per new frame, the masked
    step more than the unmasked one, and snac's Snake counts as one kernel per activation."""
    from gateway.benchmarks import snac_work

    out = tmp_path / "snac_work.json"
    assert snac_work.main(["--out", str(out), "--no-compiled"]) == 0
    variants = json.loads(out.read_text())["variants"]
    stream, masked, windows = variants["stream"], variants["stream masked"], variants["windows"]
    assert 2.0 < windows["mb_per_frame"] / stream["mb_per_frame"] < 3.0
    assert masked["mb_per_frame"] > stream["mb_per_frame"] and masked["kernels"] > stream["kernels"]
    assert stream["by_kind"]["snake"]["kernels"] == windows["by_kind"]["snake"]["kernels"] == 29
    assert "index_select" in stream["by_kind"] and "index_select" not in windows["by_kind"]


def test_snac_profile_runs_and_sorts_kernels_into_kinds(tmp_path: Path) -> None:
    """tools/device/snac_profile.py: its CPU smoke run profiles both decoders, and CUDA kernel names (as an H200's
    profiles show them) land in the kinds that say what bounds a step."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tools" / "device"))
    try:
        import snac_profile
    finally:
        sys.path.pop(0)
    out = tmp_path / "profile.json"
    assert snac_profile.main(["--device", "cpu", "--batch", "2", "--steps", "1", "--dtype", "float32",
                              "--variants", "windows,stream", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    assert set(variants) == {"windows", "stream"} and all(v["step_us"] > 0 and v["kernels"] for v in variants.values())
    names = {
        "void at::native::(anonymous namespace)::conv_depthwise2d_forward_kernel<1, float, int>": "conv depthwise",
        "triton_poi_fused_add_cat_mul_sin_0": "Inductor",
        "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nchw": "conv / GEMM",
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>": "elementwise",
        "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 3, 64, 64>": "cat",
        "void at::native::index_elementwise_kernel<128, 4>": "gather",
        "Memcpy HtoD (Pinned -> Device)": "memcpy",
        "fused_add_mul_pow_reciprocal_sin": "Snake",
    }
    assert all(snac_profile.kind_of(name).startswith(kind) for name, kind in names.items()), {
        name: snac_profile.kind_of(name) for name in names}


def test_a_server_underrun_is_a_stall_at_0_ms_only() -> None:
    """A one-frame server underrun reads as audio at the client (Opus' spill), so at 0 ms the server's count
    decides; a buffered listener's figure stays the client's."""
    from gateway.benchmarks.records import RequestRecord, apply_arrivals, count_server_underruns

    arrivals = [(0.1 + 0.02 * i, 0.02) for i in range(50)]  # on time: no client stall at any buffer
    records = []
    for underruns in (0, 2):
        record = RequestRecord(user=0, index=0, lang="en", size="short", chars=10, sent_at_s=0.0)
        apply_arrivals(record, arrivals, [0, 500], 10.0, keep=False)
        record.server = {"underruns": underruns, "underrun_ms": 20 * underruns}
        count_server_underruns(record)
        records.append(record)
    clean, underran = records
    assert not clean.playback["0"]["stalled"] and "server_underruns" not in clean.playback["0"]
    assert underran.playback["0"] == {"stalled": True, "stalls": 2, "stall_ms": 40, "max_late_ms": 0.0,
                                      "server_underruns": 2}
    assert not underran.playback["500"]["stalled"]


@pytest.mark.engine
async def test_webrtc_peers_ask_for_the_listener_buffer(synthesizer: Synthesizer,
                                                         test_config: GatewayConfig) -> None:
    """--listener-buffer-ms reaches the server: the bench's peers ask for it and the session's `ready` says so."""
    from gateway.benchmarks.webrtc_level import LocalGateway, close_all, connect_all
    from gateway.devtools.client import HeadlessPeer

    async with LocalGateway(test_config, synthesizer) as gateway:
        peers = await connect_all(gateway.base_url, 2, 2, jitter_buffer_ms=300)
        try:
            assert all(isinstance(p, HeadlessPeer) for p in peers)
            assert [p.find("ready")[0].message["jitter_buffer_ms"] for p in peers  # type: ignore[union-attr]
                    ] == [300, 300]
        finally:
            await close_all(gateway.base_url, peers)


def test_a_listener_buffer_the_gateway_holds_sets_the_stall_views() -> None:
    """--listener-buffer-ms: the stall views are total buffers (none below the one the gateway holds); over WebRTC
    the server held that much, so the client side plays with the rest, and the server's underruns count in the
    view of its own buffer."""
    from gateway.benchmarks.records import RequestRecord, apply_arrivals, count_server_underruns

    options = parse_options(["--listener-buffer-ms", "500"])
    assert (options.listener_buffer_ms, options.buffers_ms) == (500, [500])
    assert parse_options(["--listener-buffer-ms", "300", "--buffers-ms", "0,300,800"]).buffers_ms == [300, 800]
    for bad in (["--listener-buffer-ms", "500", "--buffers-ms", "0,200"], ["--listener-buffer-ms", "-5"]):
        with pytest.raises(SystemExit):
            parse_options(bad)

    late = [(0.1 + 0.02 * i + (0.3 if i >= 10 else 0.0), 0.02) for i in range(50)]  # frame 10 300 ms late
    record = RequestRecord(user=0, index=0, lang="en", size="short", chars=10, sent_at_s=0.0)
    apply_arrivals(record, late, [500, 1000], 10.0, keep=False, held_ms=500)
    record.server = {"underruns": 1, "underrun_ms": 300}
    count_server_underruns(record, 500)
    assert record.playback["500"]["stalled"] and record.playback["500"]["server_underruns"] == 1
    assert not record.playback["1000"]["stalled"]  # 500 ms more at the client absorb it
    unheld = RequestRecord(user=0, index=0, lang="en", size="short", chars=10, sent_at_s=0.0)
    apply_arrivals(unheld, late, [500], 10.0, keep=False)
    assert not unheld.playback["500"]["stalled"]  # the same arrivals, 500 ms buffered at the client


def test_device_stage_folders_fit_a_call_and_join_back_to_the_same_files(tmp_path: Path) -> None:
    """tools/device/pack.py: every folder stays within a call's carry, a file larger than a part is cut, and the
    stage calls' merge joins each file back byte for byte, checked against the digests only once all are in."""
    import os
    import shutil

    sys.path.insert(0, str(Path(__file__).parent.parent / "tools" / "device"))
    try:
        import pack
    finally:
        sys.path.pop(0)
    devcarry = tmp_path / "devcarry"
    originals = {}
    for index, group in enumerate(pack.GROUPS):
        for size in (5000 * (index + 1), 300):
            path = devcarry / group / f"file{size}.bin"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
            originals[f"{group}/{path.name}"] = path.read_bytes()
    out = devcarry / "stage"
    calls = pack.pack(devcarry, out, call_bytes=12000, part_bytes=4000)
    assert all(sum(n for *_, n in files) <= 12000 for files in calls) and len(calls) > 2
    assert any(".part." in name for files in calls for _, name, _ in files)
    stage = tmp_path / "device-stage"
    for index in range(1, len(calls) + 1):
        shutil.copytree(out / f"{index:02d}", stage, dirs_exist_ok=True)
        _, missing = pack.join(stage)
        assert bool(missing) == (index < len(calls))
    assert {str(p.relative_to(stage)): p.read_bytes() for p in stage.rglob("*.bin")} == originals
    (stage / "cur1" / "file5000.bin").write_bytes(b"changed")
    with pytest.raises(SystemExit, match="differ"):
        pack.join(stage)


def test_views_read_a_kept_run_again_with_other_client_buffers(tmp_path: Path, capsys: Any) -> None:
    """benchmarks.views: a stream whose frame comes 30 ms late stalls with no client buffer and plays at 40 ms; one the
    server ran dry stalls in every view; a run without arrivals is refused."""
    import gzip

    from gateway.benchmarks import views

    frames = [[100.0 + 20 * i + (30 if i >= 10 else 0), 20.0] for i in range(50)]
    on_time = [[100.0 + 20 * i, 20.0] for i in range(50)]
    request = {"index": 0, "lang": "en", "size": "short", "chars": 10, "sent_at_s": 0.0, "ok": True}
    point = {"users": 3, "requests": [  # user 1: a fast start (audio 5 ms after its first frame) the server ran dry
        {**request, "user": 0, "arrivals": frames, "server": {"underruns": 0, "ttfw_ms": 80.0, "ttfa_ms": 160.0}},
        {**request, "user": 1, "arrivals": on_time, "server": {"underruns": 1, "ttfw_ms": 60.0, "ttfa_ms": 65.0}},
        {**request, "user": 2, "arrivals": on_time, "server": {"underruns": 0, "ttfw_ms": 90.0, "ttfa_ms": 200.0}}]}
    run = {"options": {"stall_tolerance_ms": 10.0, "listener_buffer_ms": 0},
           "scenarios": [{"scenario": "streaming", "level": "webrtc", "points": [point]}]}
    path = tmp_path / "bench.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(run, f)
    assert {b: (v["streams_stalled"], v["realtime_users"])
            for b, v in views.point_views(point["requests"], 3, [0, 40], 10.0).items()} == {0: (2, 1), 40: (1, 2)}
    assert views.main([str(path), "--buffers-ms", "0,40"]) == 0
    printed = capsys.readouterr().out
    assert "| 3 | 2 / 1 | 1 / 2 |" in printed
    assert views.start_underruns(point["requests"]) == {"fast_starts": 1, "fast_starts_dry": 1, "other_starts": 2,
                                                        "other_starts_dry": 0}
    assert "| 3 | 1 | 1 | 2 | 0 |" in printed
    assert views.start_underruns([{"server": None}]) is None  # not WebRTC: no server figures
    # a peer refused at its offer kept no arrivals, as in the run: not real time, and the rest still read
    refused = {**request, "user": 3, "ok": False, "error": "connect: at_capacity", "arrivals": None, "server": None}
    assert views.point_views([*point["requests"], refused], 4, [40], 10.0)[40]["realtime_users"] == 2
    del point["requests"][0]["arrivals"]
    with pytest.raises(SystemExit, match="keep-arrivals"):
        views.point_views(point["requests"], 3, [0], 10.0)


def test_stalls_are_placed_in_moments_and_client_processes() -> None:
    """Streams of two client processes that stall at the same moment of the point's clock are one moment, whatever
    their sending times; a third process's stall half a second later is another; a stall counted from a server
    underrun alone has no client-seen place."""
    from gateway.benchmarks.records import RequestRecord, apply_arrivals, count_server_underruns, summarize
    from gateway.benchmarks.report import markdown_table

    def record(user: int, sent_at_s: float, late_at_s: float | None, process: int, underruns: int = 0
               ) -> RequestRecord:
        frames = [0.1 + 0.02 * i for i in range(50)]
        arrivals = [(t + (0.05 if late_at_s is not None and sent_at_s + t >= late_at_s else 0.0), 0.02)
                    for t in frames]
        made = RequestRecord(user=user, index=0, lang="en", size="short", chars=10, sent_at_s=sent_at_s, ok=True,
                             client_process=process)
        apply_arrivals(made, arrivals, [0, 500], 10.0, keep=False)
        made.server = {"underruns": underruns, "underrun_ms": 20 * underruns}
        count_server_underruns(made)
        return made

    records = [record(0, 0.0, 0.5, 0), record(1, 0.2, 0.5, 1), record(2, 0.0, 1.0, 2), record(3, 0.0, None, 0),
               record(4, 0.0, None, 1, underruns=1)]
    assert records[0].playback["0"]["first_stall_ms"] == pytest.approx(500 + 50, abs=21)
    played = summarize(records, 5, [0, 500])["playback"]
    assert played["0"]["streams_stalled"] == 4
    assert (played["0"]["stall_moments"], played["0"]["stalled_client_processes"]) == (2, 3)
    assert (played["500"]["stall_moments"], played["500"]["stalled_client_processes"]) == (0, 0)
    table = markdown_table("streaming", "webrtc", [{"summary": summarize(records, 5, [0, 500])}], [0, 500])
    assert "stall moments @0 ms" in table and "| 2 (3 procs) |" in table
    for r in records:
        r.client_process = None  # peers in the bench's own process
    assert summarize(records, 5, [0])["playback"]["0"]["stalled_client_processes"] is None


def test_underruns_are_placed_at_the_start_the_middle_or_the_end() -> None:
    from gateway.benchmarks.records import underruns_where

    servers = [{"audio_ms": 5000, "underrun_at_ms": [80, 2400, 4960]}, {"audio_ms": 900, "underrun_at_ms": [200]},
               {"audio_ms": 3000}]
    assert underruns_where(servers) == {"first_second": 2, "middle": 1, "last_100_ms": 1}


def test_snac_work_counts_the_selects_a_fused_kernel_evaluates() -> None:
    """benchmarks.snac_work's evaluated operations: a row written by slice copies (the compiled SNAC step's old state
    write) becomes a chain of selects that every value evaluates; the same row written by one cat does not."""
    import torch._inductor.config as inductor_config

    from gateway.benchmarks import snac_work

    def by_slices(pieces: list[torch.Tensor]) -> torch.Tensor:
        row = torch.empty(pieces[0].shape[0], sum(p.shape[1] for p in pieces))
        at = 0
        for piece in pieces:
            row[:, at:at + piece.shape[1]].copy_(piece * 2.0)
            at += piece.shape[1]
        return row

    def by_cat(pieces: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([p * 2.0 for p in pieces], dim=1)

    pieces = [torch.randn(2, width) for width in (3, 5, 6, 9, 10, 12, 14, 18, 20, 27)]
    evaluated = {}
    for write in (by_slices, by_cat):
        torch._dynamo.reset()
        with inductor_config.patch(fx_graph_cache=False), snac_work.scheduler_nodes() as graphs:
            assert torch.equal(torch.compile(write, fullgraph=True)(pieces), by_cat(pieces))
        evaluated[write.__name__] = sum(n.values * n.ops for n in snac_work.evaluated_ops(graphs[-1]))
    values = sum(p.numel() for p in pieces)
    assert evaluated["by_cat"] == 3 * values  # load, multiply, store
    assert evaluated["by_slices"] > 5 * evaluated["by_cat"], evaluated


def test_snac_work_sees_a_gpu_recompute_what_a_cat_used_only_by_taps_holds() -> None:
    """With cats lowered as for a GPU, a history + fresh values concatenation that only a convolution's shifted
    taps read is inlined into them, so each tap recomputes the fresh values (here a sine); a second use of the
    fresh values (the new history, as `_Decoder.stream` takes it) makes Inductor write the concatenation once."""
    import torch._inductor.config as inductor_config

    from gateway.benchmarks import snac_work

    def taps(history: torch.Tensor, x: torch.Tensor, tail_from_fresh: bool) -> tuple[torch.Tensor, torch.Tensor]:
        fresh = torch.sin(x)
        joined = torch.cat([history, fresh], dim=2)
        out = sum(joined[..., k:k + x.shape[-1]] * (k + 1.0) for k in range(7))
        return out, (fresh if tail_from_fresh else joined)[..., -6:].clone()

    history, x = torch.randn(2, 4, 6), torch.randn(2, 4, 64)
    sines = {}
    for tail_from_fresh in (False, True):
        torch._dynamo.reset()
        with (inductor_config.patch(fx_graph_cache=False), snac_work.cuda_cat_lowering(),
              snac_work.scheduler_nodes() as graphs):
            out, _ = torch.compile(taps, fullgraph=True)(history, x, tail_from_fresh)
        torch.testing.assert_close(out, taps(history, x, tail_from_fresh)[0])
        sines[tail_from_fresh] = sum(n.values * n.sins for n in snac_work.evaluated_ops(graphs[-1]))
    assert sines[True] == x.numel()  # each fresh value's sine once
    assert sines[False] >= 7 * x.numel(), sines  # once per tap


def test_snac_counters_sum_every_decoder_in_a_merged_exposition() -> None:
    """SNAC's batching over `--gateway-url` comes from the gateway's merged /metrics: the counters of each
    process that decodes (here two, as two workers' own decoders) add up; buckets and other metrics do not."""
    from prometheus_client import CollectorRegistry

    from gateway.benchmarks.gateway_procs import snac_counters
    from gateway.service.metrics import Metrics, SnacMetrics, merge_worker_expositions

    first, second = SnacMetrics(CollectorRegistry()), SnacMetrics(CollectorRegistry())
    first.observe_decode_batch(64, 0.004, 1, 64)
    first.observe_decode_batch(32, 0.002, 1, 30)
    second.observe_decode_batch(8, 0.001, 1, 8)
    first.observe_first_audio(True, 0.2, 0.06)
    second.observe_first_audio(False, 0.05, None)  # a fast start: no pace read
    second.observe_first_audio(False, 0.1, 0.04)
    merged = merge_worker_expositions({"w0": first.render().decode(), "snac": second.render().decode(),
                                       "w1": Metrics().render().decode()})
    totals = snac_counters(merged.decode())
    assert totals == {"batches": 3, "windows": 104, "busy_s": pytest.approx(0.007), "frames": 102,
                      "first_audios": 3, "start_hold_s": pytest.approx(0.35), "paced_starts": 2,
                      "start_pace_s": pytest.approx(0.1), "exact_starts": 1}
    assert snac_counters(Metrics().render().decode()) == dict.fromkeys(totals, 0.0)


def test_cpu_by_kind_counts_a_process_started_mid_point_from_zero() -> None:
    from gateway.benchmarks.gateway_procs import cpu_by_kind

    before = {10: ("worker", 5.0), 11: ("worker", 7.0), 12: ("snac", 2.0)}
    after = {10: ("worker", 6.5), 11: ("worker", 7.5), 13: ("snac", 0.4)}  # the SNAC process was restarted
    assert cpu_by_kind(before, after) == {"worker": 2.0, "snac": 0.4}


def test_the_longest_decoder_tick_between_two_readings_comes_from_the_counts() -> None:
    """benchmarks.probes reads the decoder's tick counts at a point's start and end (it no longer resets the decoder's
    own maximum): the longest tick in between, in whole ms; the longest before the point does not count."""
    from gateway.benchmarks.probes import longest_tick_ms
    from gateway.speech.stream_decoder import TICK_MS_BUCKETS, DecodeStats

    stats = DecodeStats()
    stats.count_tick(0.250)  # before the point
    before = list(stats.tick_ms)
    stats.count_tick(0.0123)
    stats.count_tick(0.0031)
    after = list(stats.tick_ms)
    assert longest_tick_ms(before, after) == 12 and stats.longest_tick_s == 0.250
    assert longest_tick_ms(after, list(stats.tick_ms)) is None  # no tick since
    stats.count_tick(3.0)
    assert longest_tick_ms(after, list(stats.tick_ms)) == TICK_MS_BUCKETS - 1  # 1 s or more


def test_snac_roofline_counts_the_flops_torch_counts_for_a_full_decode(tmp_path: Path) -> None:
    """gateway.benchmarks.snac_roofline (CPU smoke): its FLOPs per audio second, counted from the layers' shapes,
    agree with torch's FLOP counter on `SNAC.decode` of the same model (within the transposed convolutions'
    recomputed history), and every layer of the decoder gets a row with a time."""
    from snac import SNAC
    from torch.utils.flop_counter import FlopCounterMode

    from gateway.benchmarks import snac_roofline
    from gateway.devtools.devmodels import SNAC_24KHZ_CONFIG

    out = tmp_path / "roofline.json"
    assert snac_roofline.main(["--device", "cpu", "--batch", "2", "--reps", "1", "--dtype", "float32",
                               "--peak-tflops", "1", "--peak-tbps", "0.05", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    layers = result["layers"]
    assert len(layers) == 2 + 4 * (2 + 2 + 3 * 5) + 3 and all(r["step_us"] > 0 for r in layers)
    # The limit is the slower of arithmetic and traffic at the given peaks: 1 TFLOP/s, 50 GB/s.
    for r in layers:
        assert r["limit_us"] == pytest.approx(max(r["flops"] / 1e12, r["bytes"] / 5e10) * 1e6)
    assert {r["bound"] for r in layers} == {"compute", "memory"}
    assert result["totals"]["fused_limit_us"] < result["totals"]["limit_us"]
    frames = 12
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    codes = [torch.zeros(1, frames * n, dtype=torch.long) for n in (1, 2, 4)]
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.decode(codes)
    audio_s = frames * snac_roofline.SAMPLES_PER_FRAME / snac_roofline.SAMPLE_RATE
    torch_gflop = counter.get_total_flops() / audio_s / 1e9
    conv_gflop = sum(r["gflop_per_audio_s"] for r in layers if r["kind"].startswith("conv"))
    assert torch_gflop <= conv_gflop <= 1.1 * torch_gflop, (conv_gflop, torch_gflop)


@pytest.mark.engine
async def test_text_doors_measure_a_running_gateway_at_several_utterances_at_once(
        synthesizer: Synthesizer, test_config: GatewayConfig) -> None:
    """benchmarks.text_doors (the `--gateway-url` path, CPU smoke): two utterances at once through each door, their
    first audio and first words timed; the CLI's concurrency list refuses what it cannot run."""
    from gateway.benchmarks import text_doors

    async with running(replace(test_config, max_tokens=28), synthesizer) as (base, _gateway):
        result = await text_doors.measure(base, [2], utterances=2)
    assert set(result["results"]) == {"2"}
    for door in text_doors.DOORS:
        samples = result["samples_s"]["2"][door]
        assert len(samples["first_audio"]) == len(samples["first_words"]) == 2
        assert all(0 < s < text_doors.TIMEOUT_S for s in samples["first_audio"] + samples["first_words"])
        assert result["results"]["2"][door]["first_audio"]["n"] == 2
    assert positive_int_list("1,64") == [1, 64]
    for bad in ("0", "1,x", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_int_list(bad)


def test_class_sim_scripted_once_bound_of_fixed_texts() -> None:
    """class_sim's bound: every free line's sentence caps plus each distinct scripted sentence's cap once (a
    sentence shared by two scripted lines counts once); the caps are the gateway's per-character rule, in whole
    frames, clamped by max_tokens; the table shows the bound only when it is known, an empty kind as "-"."""
    from gateway.benchmarks import class_sim

    said = [class_sim.Result(0, "miss", 0.1, True, "Bom dia! Como você está?", 1.0),
            class_sim.Result(1, "hit", 0.0, True, "Bom dia! Como você está?", 1.0),
            class_sim.Result(1, "miss", 0.1, True, "Bom dia!", 0.5),
            class_sim.Result(0, "free", 0.1, True, "Student 0 asks a free question number 1.", 1.0),
            class_sim.Result(1, "free", 0.1, True, "Student 1 asks a free question number 0.", 1.0)]
    # 8, 15 and 40 characters at 0.5 a character: 1, 2 and 3 frames of 7 tokens.
    assert class_sim.token_bound(said, class_sim.TokenCaps(0.5, 140)) == 7 + 14 + 21 + 21
    # At 6 a character every sentence reaches max_tokens (28: 4 frames).
    assert class_sim.token_bound(said, class_sim.TokenCaps(6.0, 28)) == 28 * 4
    assert class_sim.p([], 50) is None
    run = class_sim.Run("on", 2, "tara", tokens=84.0, results=said)
    assert "token bound" not in class_sim.report([run], 2, 0.4)
    run.token_bound = class_sim.token_bound(said, class_sim.TokenCaps(6.0, 28))
    assert class_sim.summary(run)["tokens_vs_bound"] == pytest.approx(84 / 112)
    silent = class_sim.Run("off", 2, "tara", token_bound=0)  # nothing said: no ratio, no TTFA
    rows = class_sim.report([run, silent], 2, 0.4).splitlines()[-2:]
    assert rows == ["| 2 | on | 84 | 112 | 0.75 | 0 / 0 | 100 / 100 | 100 / 100 | 5 of 5 | 2 of 2 | 0 | 0 |",
                    "| 2 | off | 0 | - | - | - | - | - | 0 of 0 | 2 of 2 | 0 | 0 |"]


@pytest.mark.engine
async def test_class_sim_cache_on_generates_each_scripted_line_once(synthesizer: Synthesizer,
                                                                    test_config: GatewayConfig,
                                                                    tmp_path: Path, monkeypatch: Any) -> None:
    """benchmarks.class_sim (the `--gateway-url` path, CPU smoke, a two-line lesson, no free lines): one gateway with
    `--phrase-cache marked` serves both modes; off, every line goes to the engine and nothing is a hit; on, each
    line is generated once (single flight) and the gateway counts its hits. With the engine's caps (0.5 tokens a
    character), the on run stays within the scripted-once bound of what was said and the off run within every
    line's cap; its JSON has no NaN. A second class with free lines and `--listen`: each student heard every line
    out (first audio + buffer + duration) before its next, and the bound counts its free lines."""
    from gateway.benchmarks import class_sim
    from gateway.orpheus import sentence_token_cap, split_sentences

    tokens_per_char = 0.5  # caps of 1 to 3 frames: the tiny model reaches them before it stops
    monkeypatch.setattr(synthesizer, "config", replace(synthesizer.config, max_tokens_per_char=tokens_per_char))
    caps = class_sim.TokenCaps(tokens_per_char, synthesizer.config.max_tokens)

    def cap(text: str) -> int:
        return sum(sentence_token_cap(len(s), tokens_per_char, caps.max_tokens) for s in split_sentences(text))

    config = replace(test_config, max_tokens=28, max_tokens_per_char=tokens_per_char, phrase_cache="marked",
                     phrase_cache_dir=str(tmp_path / "phrases"))
    async with running(config, synthesizer) as (base, _gateway):
        off, on = await class_sim.measure(base, [3], lines=2, free=0.0, seed=1, caps=caps)
        heard = await class_sim.measure(base, [2], lines=2, free=0.5, seed=3, caps=caps, listen=True)
    assert (off.mode, on.mode) == ("off", "on") and off.voice == on.voice
    assert len(off.results) == len(on.results) == 6
    assert off.hits_counted == 0 and not [r for r in off.results if r.kind == "hit"]
    assert 0 < on.tokens <= off.tokens / 2
    assert on.hits_counted >= len([r for r in on.results if r.kind == "hit"])
    figures = class_sim.summary(on)
    assert figures["requests"] == 6 and 0 <= figures["real_time_students"] <= 3

    lesson_sentences = {s for line in class_sim.LESSON[:2] for s in split_sentences(line)}
    assert on.token_bound == off.token_bound == sum(map(cap, lesson_sentences)) > 0
    assert on.tokens <= on.token_bound * 1.05
    assert off.tokens <= sum(cap(r.text) for r in off.results)
    assert figures["tokens_vs_bound"] == pytest.approx(on.tokens / on.token_bound)
    args = argparse.Namespace(json=str(tmp_path / "class_sim.json"), free=0.0, lines=2, listen=False,
                              tokens_per_char=tokens_per_char, max_tokens=caps.max_tokens, gateway_url=base)
    class_sim.save_json(args, [off, on])

    def no_constant(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")
    saved = json.loads((tmp_path / "class_sim.json").read_text(), parse_constant=no_constant)
    assert saved["runs"][1]["ttfa"]["free"] == {"n": 0, "p50_ms": None, "p95_ms": None}
    assert saved["runs"][1]["token_bound"] == on.token_bound and saved["listen"] is False

    for run in heard:
        assert len(run.results) == 4 and "free" in {r.kind for r in run.results} != {"free"}
        scripted = {s for r in run.results if r.kind != "free" for s in split_sentences(r.text)}
        assert run.token_bound == sum(cap(r.text) for r in run.results if r.kind == "free") + sum(map(cap, scripted))
        assert run.tokens <= (run.token_bound * 1.05 if run.mode == "on" else sum(cap(r.text) for r in run.results))
        assert all(r.audio_s > 0 for r in run.results)
        for k in range(2):
            listened = sum(class_sim.BUFFER_S + r.audio_s for r in run.results if r.student == k)
            assert listened <= run.wall_s


# --- several models on one engine process (issue 37): the benchmark's own table on two tiny engines ----------------

def test_bench_models_table_and_its_options(tiny_model_dir: Path, tiny_snac_dir: Path, tmp_path: Path) -> None:
    """--models 2 serves the checkpoint twice (en, pt: one voice and language each, an even share of the GPU each)
    with the LoRA voice on en, a random adapter of every attention and MLP projection (B zero where it writes the
    residual stream); traffic splits give each model its share of the users; bad combinations are refused."""
    from safetensors.torch import load_file

    from gateway.devtools.devmodels import ALL_LORA_TARGETS

    config = bench_models_config(tiny_model_dir, tiny_snac_dir, tmp_path)
    table = config.model_table
    assert list(table.bases) == ["en", "pt"] and table.engine_of("tutor")[0] == "en"
    assert [table.language_of(v) for v in ("tara", "ana", "tutor")] == ["en-US", "pt-BR", "en-US"]
    assert config.for_model("pt").gpu_memory_utilization == pytest.approx(config.gpu_memory_utilization / 2)
    adapter = Path(table.engine_of("tutor")[1].path)  # type: ignore[union-attr]
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == list(ALL_LORA_TARGETS)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    assert len(tensors) == 2 * 2 * len(ALL_LORA_TARGETS)  # A and B, 2 layers
    assert not tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].any()
    assert tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"].any()
    assert traffic_voices(table, "80/20", 5) == ["tara", "ana", "tara", "tara", "tara"]
    assert traffic_voices(table, "50/50", 4).count("ana") == 2
    assert span_language(table) == "pt-BR" and lora_voices(table) == ("tara", "tutor")
    for argv, message in [(["--scenario", "mixed-spans"], "needs --models 2"),
                          (["--scenario", "lora"], "needs --lora-voice"),
                          (["--models", "2", "--traffic", "50/30/20"], r"one share per model \(2\)")]:
        with pytest.raises(SystemExit, match=message):
            parse_options(argv)
    with pytest.raises(SystemExit):
        parse_options(["--traffic", "60/50"])  # argparse: not summing to 100


@pytest.mark.engine
async def test_bench_models_traffic_lora_and_mixed_spans(two_tiny_engines: Synthesizer, tmp_path: Path,
                                                         capsys: Any) -> None:
    """The several-models scenarios end to end on two real tiny engines and a LoRA voice: each split's streams reach
    their models in its shares, the LoRA point speaks the adapter's voice on its base's engine, each mixed-span
    utterance crosses two span boundaries (its quote by the pt engine) and the stall check counts underruns there;
    every prompt had its budget; each engine's KV cache is reported."""
    synth = two_tiny_engines  # the session's pair, built from this very table
    before = {name: engine.requests_started for name, engine in synth.engines.items()}
    options = parse_options([*BENCH_MODEL_ARGS, "--out", str(tmp_path)])
    run = await run_scenarios(synth, synth.config, options, BENCH_MODEL_ARGS)

    saved = json.loads((tmp_path / "bench.json").read_text())
    assert [(s["scenario"], s["variant"]) for s in saved["scenarios"]] == [
        ("traffic", "75/25"), ("lora", "base"), ("lora", "lora"), ("mixed-spans", None)]
    assert saved["unbudgeted_requests"] == 0
    memory = saved["models"]["memory"]["engines"]
    assert set(memory) == {"en", "pt"}
    assert all(m["blocks"] > 0 and m["tokens"] == m["blocks"] * m["block_size"] and m["core_pids"]
               for m in memory.values())
    assert {v["name"]: v["model"] for v in saved["models"]["served"]} == {"tara": "en", "ana": "pt", "tutor": "en"}
    by_entry = {(s["scenario"], s["variant"]): s["points"] for s in run["scenarios"]}
    for points in by_entry.values():
        for point in points:
            summary = point["summary"]
            assert summary["ok"] == summary["requests"] == point["users"], summary["errors"]
    (traffic,) = by_entry[("traffic", "75/25")]
    assert {voice: v["streams"] for voice, v in traffic["summary"]["by_voice"].items()} == {"tara": 3, "ana": 1}
    for variant, voice in (("base", "tara"), ("lora", "tutor")):
        (point,) = by_entry[("lora", variant)]
        assert list(point["summary"]["by_voice"]) == [voice] and point["summary"]["by_voice"][voice]["ok"] == 2
    one, two = by_entry[("mixed-spans", None)]
    assert (one["users"], two["users"]) == (1, 2)
    for point in (one, two):
        spans = point["summary"]["span_boundaries"]
        assert spans["boundaries"] == 2 * point["users"] and set(spans["underruns"]) == {"0", "500"}
        assert all(r["boundaries"] == 2 and "boundary_stalls" in r["playback"]["0"] for r in point["requests"])
    added = {name: engine.requests_started - before[name] for name, engine in synth.engines.items()}
    # pt: traffic's one stream, and each mixed-span utterance's quote (1 + 2); en: the rest, sentence by sentence
    assert added["pt"] == 1 + 3 and added["en"] > 3 + 2 + 2
    tables = capsys.readouterr().out
    assert "### traffic 75/25 (engine)" in tables and "real-time streams @500 ms" in tables and "tara " in tables
    assert "boundary underruns @0 ms" in tables
