"""All WebRTC sessions of this process: opening one from an offer, and closing them all."""

from __future__ import annotations

import asyncio
import uuid

from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription

from gateway.rtc.ice import ice_servers
from gateway.rtc.sctp import clamp_sctp_fragments
from gateway.rtc.services import SessionServices
from gateway.rtc.session import Session
from gateway.service.admission import Slot


class SessionManager:
    """Sessions by id. Ids start with `id_prefix` (`w<index>-` in a worker of `serve --workers`: who owns a
    session)."""

    def __init__(self, services: SessionServices, id_prefix: str = "") -> None:
        clamp_sctp_fragments()  # before any peer: every data channel of this process fits a 1280 B path
        self.services = services
        self.id_prefix = id_prefix
        self.sessions: dict[str, Session] = {}

    def new_session_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex

    def ice_configuration(self, session_id: str) -> RTCConfiguration:
        """The gateway's side: the configured servers, with TURN credentials minted for this session."""
        servers = [RTCIceServer(urls=list(s.urls), username=s.username, credential=s.credential)
                   for s in ice_servers(self.services.config, session_id)]
        return RTCConfiguration(iceServers=servers)  # [] (not None): no public STUN server is contacted

    def session(self, pc: RTCPeerConnection, session_id: str, voice: str, jitter_buffer_ms: int,
                slot: Slot | None = None, *, expect_channel: bool = True) -> Session:
        """A session of this manager on `pc` (not yet negotiated)."""
        return Session(self.services, pc, session_id, voice, jitter_buffer_ms, slot, on_closed=self.forget,
                       expect_channel=expect_channel)

    async def open(self, offer: RTCSessionDescription, voice: str, jitter_buffer_ms: int, slot: Slot, *,
                   expect_channel: bool = True) -> Session:
        """A session answering `offer`; it holds `slot` until it closes (released here if it cannot open).
        `expect_channel=False`: the offer opens no data channel (audio only), so none is waited for."""
        try:
            # The id comes first: the gateway's TURN username (`<expiry>:<session id>`) names the session.
            session_id = self.new_session_id()
            pc = RTCPeerConnection(self.ice_configuration(session_id))
            session = self.session(pc, session_id, voice, jitter_buffer_ms, slot, expect_channel=expect_channel)
        except BaseException:
            slot.release()
            raise
        self.sessions[session.id] = session
        self.services.metrics.sessions_active.inc()
        self.services.metrics.sessions_total.inc()
        try:
            await pc.setRemoteDescription(offer)
            answer = await pc.createAnswer()
            await pc.setLocalDescription(answer)  # aiortc gathers every candidate here (no trickle)
        except BaseException:
            await session.close()
            raise
        return session

    def forget(self, session: Session) -> None:
        if self.sessions.pop(session.id, None) is not None:
            self.services.metrics.sessions_active.dec()

    async def close_all(self) -> None:
        await asyncio.gather(*(s.end("shutting_down", "the gateway is shutting down; connect again shortly")
                               for s in list(self.sessions.values())), return_exceptions=True)
