// One WebRTC session with the gateway: a non-trickle offer/answer over HTTP, then the `control`
// data channel for speak/repeat/cancel/played/ping. Emits: `track` {stream}, `message` {msg}, `state` {state},
// `closed` {reason: 'silent' when the server stopped answering, 'closed' when the channel closed; with 'closed', the
// `code`, `message` and `retryAfterS` of the session-level `error` the server ended it with, if it said why}.

const PING_INTERVAL_MS = 2000; // the gateway treats these pings as a heartbeat
// Nothing heard on the data channel for this long (three pings unanswered): the server is gone without a word.
// A killed gateway worker closes nothing; ICE consent checks notice it only after ~30 s (bench.faults).
const SERVER_SILENT_MS = 6500;
const MAX_WIRE_RECORDS = 200;
const ICE_GATHERING_TIMEOUT_MS = 5000;
const ICE_SERVERS_TIMEOUT_MS = 5000;
// An offer the server does not answer in this long has failed (a reconnect attempt must not hang for ever); the
// server answers after its own ICE gathering, a few seconds at most.
const OFFER_TIMEOUT_MS = 20000;

// A gateway with auth on needs a token: the lesson backend opens the page as `...?token=<token>`.
function authHeaders() {
  const token = new URLSearchParams(location.search).get('token');
  return token ? { Authorization: `Bearer ${token}` } : {};
}

/** An HTTP error answered by the gateway (`{"error": {"code", "message"}}`, with `Retry-After` at capacity). */
export class GatewayError extends Error {
  constructor(status, code, message, retryAfterS = null) {
    super(message);
    this.name = 'GatewayError';
    this.status = status;
    this.code = code;
    this.retryAfterS = retryAfterS; // seconds before asking again makes sense, when the server said
  }
}

// Retry-After is seconds or an HTTP date (RFC 9110): the gateway sends seconds, a proxy in front may send a date.
function retryAfterSeconds(header) {
  if (header == null || header.trim() === '') return null;
  const seconds = Number(header);
  if (Number.isFinite(seconds)) return Math.max(0, seconds);
  const date = Date.parse(header);
  return Number.isNaN(date) ? null : Math.max(0, (date - Date.now()) / 1000);
}

// STUN/TURN servers from the gateway, TURN credentials minted for this page (the TURN secret stays on the
// server). Without them the page still connects wherever the gateway is reachable directly, so a failure here
// is logged and the peer is made with no servers rather than the lesson failing.
async function fetchIceServers(baseUrl) {
  try {
    const response = await fetch(`${baseUrl}/v1/webrtc/ice-servers`, {
      headers: authHeaders(), cache: 'no-store', signal: AbortSignal.timeout?.(ICE_SERVERS_TIMEOUT_MS),
    });
    if (!response.ok) throw new Error(`HTTP ${response.status}`);
    const servers = (await response.json())?.ice_servers;
    if (!Array.isArray(servers)) throw new Error('the answer has no ice_servers list');
    return servers;
  } catch (error) {
    console.warn(`ICE servers unavailable (${error.message}); connecting without STUN/TURN`);
    return [];
  }
}

// RTCPeerConnection throws on a server it cannot use (a TURN url without credentials): fall back to none.
function createPeerConnection(iceServers) {
  try {
    return new RTCPeerConnection({ iceServers });
  } catch (error) {
    console.warn(`ICE servers refused by the browser (${error.message}); connecting without STUN/TURN`);
    return new RTCPeerConnection({ iceServers: [] });
  }
}

// The gateway does not trickle candidates, so the offer is sent once gathering is over.
function iceGatheringComplete(pc, timeoutMs) {
  if (pc.iceGatheringState === 'complete') return Promise.resolve();
  return new Promise((resolve) => {
    const finish = () => {
      clearTimeout(timer);
      pc.removeEventListener('icegatheringstatechange', onChange);
      resolve(); // on timeout, send what was gathered so far: host candidates come first
    };
    const onChange = () => { if (pc.iceGatheringState === 'complete') finish(); };
    const timer = setTimeout(finish, timeoutMs);
    pc.addEventListener('icegatheringstatechange', onChange);
  });
}

export class TutorConnection extends EventTarget {
  constructor(baseUrl = location.origin) {
    super();
    this.baseUrl = baseUrl;
    this.pc = null;
    this.channel = null;
    this.sessionId = null;
    this.wire = []; // {direction: offer|sent|received, message}, the last MAX_WIRE_RECORDS
    this._pingTimer = null;
    this._lastHeard = 0; // performance.now() of the last message from the server
    this._closed = false;
    this._endedWith = null; // the session-level `error` (no utterance id) last heard: why the server ends it
  }

  _emit(type, detail = {}) {
    this.dispatchEvent(new CustomEvent(type, { detail }));
  }

  /** Open the session; throws GatewayError for HTTP errors, TypeError when the server is unreachable. */
  async connect({ voice, jitterBufferMs }) {
    const iceServers = await fetchIceServers(this.baseUrl);
    if (this._closed) return; // disconnected while the servers were being fetched
    const pc = createPeerConnection(iceServers);
    this.pc = pc;
    pc.addTransceiver('audio', { direction: 'recvonly' });
    // Created before the offer so that it carries the m=application section the gateway requires.
    const channel = pc.createDataChannel('control');
    this.channel = channel;
    channel.onopen = () => this._startPing();
    channel.onmessage = (event) => this._onMessage(event.data);
    channel.onclose = () => this._onChannelClosed();
    pc.ontrack = (event) => {
      const stream = event.streams[0] ?? new MediaStream([event.track]);
      this._emit('track', { stream });
    };
    pc.onconnectionstatechange = () => this._emit('state', { state: pc.connectionState });

    await pc.setLocalDescription(await pc.createOffer());
    await iceGatheringComplete(pc, ICE_GATHERING_TIMEOUT_MS);
    const body = { sdp: pc.localDescription.sdp, type: 'offer', jitter_buffer_ms: jitterBufferMs };
    if (voice) body.voice = voice;
    this._record('offer', body);
    const response = await fetch(`${this.baseUrl}/v1/webrtc/offer`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', ...authHeaders() },
      body: JSON.stringify(body),
      signal: AbortSignal.timeout?.(OFFER_TIMEOUT_MS),
    });
    const answer = await response.json().catch(() => null);
    if (!response.ok) {
      const error = answer?.error ?? {};
      throw new GatewayError(response.status, error.code ?? 'http_error', error.message ?? response.statusText,
                             retryAfterSeconds(response.headers.get('Retry-After')));
    }
    this.sessionId = answer.session_id;
    if (this._closed) {
      await this._endSession(false); // disconnected while the offer was in flight: free the server's side
      return;
    }
    await pc.setRemoteDescription({ type: answer.type, sdp: answer.sdp });
  }

  get isOpen() {
    return this.channel?.readyState === 'open';
  }

  /** Send one control message; false when the channel is not open. */
  send(message) {
    if (!this.isOpen) return false;
    this._record('sent', message);
    this.channel.send(JSON.stringify(message));
    return true;
  }

  speak(id, text, { voice, language, interrupt = false, rate = 1, cache } = {}) {
    const message = { type: 'speak', id, text, interrupt };
    if (voice) message.voice = voice;
    if (language) message.language = language; // BCP-47: a model of that language speaks it
    if (rate !== 1) message.rate = rate;
    if (cache != null) message.cache = cache; // true: a scripted line the phrase cache may keep
    return this.send(message);
  }

  /** Play (words `fromWord`..`toWord` of) utterance `id` again as `newId`, from the server's recording. */
  repeat(id, newId, { fromWord, toWord, rate = 1, interrupt = false } = {}) {
    const message = { type: 'repeat', id, new_id: newId, interrupt };
    if (fromWord != null) message.from_word = fromWord;
    if (toWord != null) message.to_word = toWord;
    if (rate !== 1) message.rate = rate;
    return this.send(message);
  }

  /** Tell the server how much of an utterance this page played (its own playout, for the server's metrics). */
  played(id, playedMs) {
    return this.send({ type: 'played', id, played_ms: Math.max(0, Math.round(playedMs)) });
  }

  /** Cancel one utterance, or (no id) the current one and everything queued. */
  cancel(id) {
    return this.send(id ? { type: 'cancel', id } : { type: 'cancel' });
  }

  /** The last messages on the wire, as sent or received (tests check them against the protocol's schema). */
  _record(direction, message) {
    this.wire.push({ direction, message: structuredClone(message) });
    if (this.wire.length > MAX_WIRE_RECORDS) this.wire.shift();
  }

  _startPing() {
    this._stopPing();
    this._lastHeard = performance.now();
    const ping = () => {
      if (performance.now() - this._lastHeard > SERVER_SILENT_MS) {
        this._onServerSilent();
        return;
      }
      this.send({ type: 'ping', t: performance.now() });
    };
    ping();
    this._pingTimer = setInterval(ping, PING_INTERVAL_MS);
  }

  /** The server stopped answering: drop the peer (telling a silent server would wait in vain) and say so. */
  _onServerSilent() {
    this._stopPing();
    if (this._closed) return;
    this._closed = true;
    this.pc?.close();
    this._emit('closed', { reason: 'silent' });
  }

  _stopPing() {
    clearInterval(this._pingTimer);
    this._pingTimer = null;
  }

  _onMessage(data) {
    this._lastHeard = performance.now();
    let msg;
    try {
      msg = JSON.parse(data);
    } catch {
      return; // not ours to show: the protocol is JSON only
    }
    this._record('received', msg);
    if (msg.type === 'pong' && typeof msg.t === 'number') msg.rtt_ms = performance.now() - msg.t;
    if (msg.type === 'error' && !msg.id) this._endedWith = msg; // the server says why before it closes a session
    this._emit('message', { msg });
  }

  _onChannelClosed() {
    this._stopPing();
    if (this._closed) return; // closed here: nobody needs telling
    const ended = this._endedWith;
    this._emit('closed', { reason: 'closed', code: ended?.code ?? null, message: ended?.message ?? null,
                           retryAfterS: ended?.retry_after_s ?? null });
  }

  /** End the session: tell the server (best effort), then close the peer. */
  async close({ keepalive = false } = {}) {
    if (this._closed) return;
    this._closed = true;
    this._stopPing();
    this.pc?.close();
    await this._endSession(keepalive);
  }

  async _endSession(keepalive) {
    if (!this.sessionId) return;
    const url = `${this.baseUrl}/v1/webrtc/sessions/${encodeURIComponent(this.sessionId)}`;
    // keepalive lets the request outlive the page when it is being closed
    await fetch(url, { method: 'DELETE', keepalive, headers: authHeaders() }).catch(() => {});
  }
}
