// The lesson page: wires the buttons to a TutorConnection, the remote audio to the <audio> element and
// the avatar, and the server's events to the phrase highlight, the karaoke (the word being heard), the
// avatar's visemes, the status line and the live panel. A lesson that was up and got lost comes back by itself
// (reconnect.js), with the page's voice and settings; what the lost session was saying is not asked for again.

import { Avatar } from './avatar.js';
import { TutorConnection } from './connection.js';
import { SpokenUtterance, heardRtp, highlightWord, renderWords } from './karaoke.js';
import { SLOW_RATE, forgetRecordings, phraseRoute, prefetchMessages, renderPhrases } from './lesson.js';
import { connectErrorMessage, eventErrorMessage, lostMessage } from './messages.js';
import { jitterBufferMaxMs, loadProtocolSchema } from './protocol.js';
import { Reconnector, isRetryable, reconnectsAfter } from './reconnect.js';
import { inboundAudio, summarize } from './stats.js';

const MAX_LOG_LINES = 60;
const STATS_INTERVAL_MS = 1000;
const PLAYED_REPORT_DELAY_MS = 300; // the end of an utterance is heard a little after the server sent it

const $ = (id) => document.getElementById(id);
const ui = {
  connect: $('connect'), disconnect: $('disconnect'), speak: $('speak'), stop: $('stop'),
  text: $('text'), voice: $('voice'), jitter: $('jitter'), interrupt: $('interrupt'),
  phrases: $('phrases'), now: $('now'), error: $('error'), log: $('log'), audio: $('remote-audio'),
  caption: $('caption'),
  state: $('stat-state'), ttfa: $('stat-ttfa'), underruns: $('stat-underruns'), rtt: $('stat-rtt'),
  jb: $('stat-jb'), packets: $('stat-packets'), lost: $('stat-lost'), concealed: $('stat-concealed'),
};

const avatar = new Avatar($('avatar'), $('mouth'));
let connection = null;
const reconnector = new Reconnector();
let lessonUp = false; // the tutor was ready since Connect was pressed: losing it now is worth coming back from
let audioContext = null;
let statsTimer = null;
let lastStats = null;
let counter = 0;
let served = { languages: [], voiceLanguages: {} }; // GET /v1/voices: the languages served, each voice's language
let peerState = 'new'; // RTCPeerConnection.connectionState, shown beside the page's own state
// id -> {text, button?, phrase?, rate, repeatOf?, spoken}: what we asked for and still expect events about
const utterances = new Map();
let current = null; // {spoken, targets, word}: the utterance being heard (karaoke and visemes follow it)
let karaokeFrame = null;
const karaokeTrail = []; // [utterance id, word index] each time the highlighted word changed (tests)
const playedReports = []; // what this page told the server it played (tests)

// --- small view helpers ------------------------------------------------------------------------------

function log(text, level = 'info') {
  const line = document.createElement('li');
  line.className = level;
  const time = new Date().toLocaleTimeString([], { hour12: false });
  line.textContent = `${time}  ${text}`;
  ui.log.append(line);
  while (ui.log.childElementCount > MAX_LOG_LINES) ui.log.firstElementChild.remove();
  ui.log.scrollTop = ui.log.scrollHeight;
}

function setNow(text, kind = '') {
  ui.now.textContent = text;
  ui.now.dataset.kind = kind;
}

function showError(text) {
  ui.error.textContent = text;
  ui.error.hidden = false;
  log(text, 'error');
}

function clearError() {
  ui.error.hidden = true;
  ui.error.textContent = '';
}

function shorten(text, max = 40) {
  return text.length > max ? `${text.slice(0, max - 1)}…` : text;
}

// 'disconnected' | 'connecting' | 'connected' (peer up, waiting for `ready`) | 'ready'
// | 'reconnecting' (the session was lost; waiting or trying again until `ready`)
function setState(state) {
  document.body.dataset.state = state;
  const ready = state === 'ready';
  ui.connect.disabled = state !== 'disconnected';
  ui.disconnect.disabled = state === 'disconnected';
  ui.speak.disabled = !ready;
  ui.stop.disabled = !ready;
  ui.jitter.disabled = state !== 'disconnected';
  for (const button of ui.phrases.querySelectorAll('button')) button.disabled = !ready;
  if (state === 'disconnected') peerState = 'new';
  renderState();
}

function renderState() {
  const state = document.body.dataset.state;
  const peer = state === 'disconnected' || peerState === 'new' ? '' : ` · peer ${peerState}`;
  ui.state.textContent = `${state}${peer}`;
}

function fillVoices(voices, selected) {
  const keep = selected ?? ui.voice.value;
  ui.voice.replaceChildren(...voices.map((name) => new Option(name, name, false, name === keep)));
}

// --- connecting ------------------------------------------------------------------------------------

async function connect() {
  clearError();
  const jitter = Number(ui.jitter.value);
  const maxJitter = jitterBufferMaxMs() ?? Number.MAX_SAFE_INTEGER; // unknown: the server says no if need be
  if (ui.jitter.value.trim() === '' || !Number.isInteger(jitter) || jitter < 0 || jitter > maxJitter) {
    showError(`The audio buffer must be a whole number of milliseconds between 0 and ${maxJitter}.`);
    return;
  }
  // Created on the click: browsers only let audio start from a user gesture.
  audioContext ??= new AudioContext();
  audioContext.resume();
  setState('connecting');
  setNow('Calling your tutor…');
  log(`Connecting (audio buffer ${jitter} ms)…`);
  await openSession();
}

// One session with the page's settings as they are now (the voice picked, the audio buffer): for Connect, and
// again for each reconnect attempt.
async function openSession() {
  const conn = new TutorConnection();
  connection = conn;
  // Events of a session the page has dropped (lost, or Disconnect pressed) no longer concern it.
  conn.addEventListener('track', ({ detail }) => { if (connection === conn) onTrack(detail.stream); });
  conn.addEventListener('message', ({ detail }) => { if (connection === conn) onMessage(detail.msg); });
  conn.addEventListener('state', ({ detail }) => onPeerState(conn, detail.state));
  conn.addEventListener('closed', ({ detail }) => { if (connection === conn) onLost(detail); });
  try {
    await conn.connect({ voice: ui.voice.value, jitterBufferMs: Number(ui.jitter.value) });
  } catch (error) {
    if (connection !== conn) return; // the student pressed Disconnect meanwhile
    conn.close();
    // Trying again by itself: while coming back from a loss, or when the server refused the first offer and said
    // when to ask again (at capacity, still starting: Retry-After). A first offer that failed otherwise (no server
    // there, a refusal about the request) is the student's to retry.
    const serverSaidWhen = isRetryable(error) && error.retryAfterS != null;
    if (!reconnector.active && !serverSaidWhen) {
      showError(connectErrorMessage(error));
      teardown();
    } else if (isRetryable(error)) {
      retryLater(connectErrorMessage(error), error.retryAfterS);
    } else { // refused (access, a voice gone): asking again would be refused again
      giveUp(`Could not reconnect. ${connectErrorMessage(error)}`);
    }
    return;
  }
  if (connection !== conn) return;
  if (document.body.dataset.state === 'connecting') setState('connected'); // `ready` may not be here yet
  log(`Session ${conn.sessionId.slice(0, 8)} opened; waiting for the tutor…`);
  clearInterval(statsTimer);
  statsTimer = setInterval(refreshStats, STATS_INTERVAL_MS);
}

// The session ended without the student asking: its channel closed, it fell silent, or its peer failed.
function onLost(detail) {
  if (detail.reason === 'closed' && !reconnectsAfter(detail.code)) {
    giveUp(eventErrorMessage(detail)); // closed for good on purpose (idle, time limit): the server's reason
  } else if (!lessonUp) {
    giveUp(`${lostMessage(detail)} Press Connect to continue.`); // it never worked: nothing to come back to
  } else {
    retryLater(lostMessage(detail), detail.retryAfterS);
  }
}

// Drop the lost session and schedule the next attempt; the error box says what happened, the status line what
// happens next (reconnector's `waiting` and `attempt`).
function retryLater(why, retryAfterS = null) {
  const conn = connection;
  dropSession({ cut: true });
  conn?.close();
  setState('reconnecting');
  showError(why);
  if (!reconnector.schedule(retryAfterS ?? null)) {
    const attempts = `${reconnector.maxAttempts} attempt${reconnector.maxAttempts === 1 ? '' : 's'}`;
    giveUp(`Could not reconnect after ${attempts}. ${why} Press Connect to try again.`);
  }
}

// No (more) coming back: the idle page, the reason, and the Connect button.
function giveUp(message) {
  const conn = connection;
  teardown();
  conn?.close();
  showError(message);
}

reconnector.addEventListener('waiting', ({ detail: { attempt, maxAttempts, delayMs } }) => {
  setNow(`Reconnecting in ${Math.ceil(delayMs / 1000)} s… (attempt ${attempt} of ${maxAttempts})`, 'reconnecting');
});
reconnector.addEventListener('attempt', ({ detail: { attempt, maxAttempts } }) => {
  setNow(`Reconnecting… (attempt ${attempt} of ${maxAttempts})`, 'reconnecting');
  log(`Reconnecting (attempt ${attempt} of ${maxAttempts})…`);
  openSession();
});

function onTrack(stream) {
  ui.audio.srcObject = stream; // this is what actually plays (see index.html)
  ui.audio.play().catch(() => log('The browser blocked sound: click anywhere on the page.', 'error'));
  avatar.attach(stream, audioContext);
}

function onPeerState(conn, state) {
  if (connection !== conn) return;
  peerState = state;
  renderState();
  if (state === 'failed') {
    onLost({ reason: 'failed' });
  } else if (state === 'disconnected') {
    log('The connection is unstable; trying to recover…', 'error');
  }
}

async function disconnect() {
  const conn = connection; // null while waiting to reconnect; an attempt's session while one is under way
  const reconnecting = reconnector.active;
  teardown(); // a pending reconnect attempt never comes
  setNow('Disconnected. Press “Connect” to continue the lesson.');
  log(reconnecting ? 'Disconnected; no more reconnecting.' : 'Disconnected.');
  await conn?.close();
}

// No session, no highlight, no sound. `cut`: the session was lost, so what it was still saying will not come
// (nor is it asked for again): it is marked as not finished.
function dropSession({ cut = false } = {}) {
  connection = null;
  clearInterval(statsTimer);
  statsTimer = null;
  avatar.detach();
  ui.audio.srcObject = null;
  stopKaraoke();
  for (const id of utterances.keys()) {
    const entry = finish(id);
    if (!cut) continue;
    entry.button?.classList.add('cut');
    log(`${id} (“${shorten(entry.text)}”) was cut off by the lost connection: not finished.`, 'error');
  }
  forgetRecordings(); // the server's recordings went with the session
  peerState = 'new';
}

// Back to the idle page, with no reconnecting pending.
function teardown() {
  dropSession();
  reconnector.reset();
  lessonUp = false;
  setState('disconnected');
  setNow('Not connected. Press “Connect” to try again.');
}

// --- speaking --------------------------------------------------------------------------------------

function speak(text, button, { rate = 1, phrase = null } = {}) {
  if (!connection?.isOpen) {
    showError('Not connected yet: press Connect first.');
    return;
  }
  clearError();
  const id = `u${++counter}`;
  utterances.set(id, { text, button, phrase, rate, spoken: new SpokenUtterance(id, text) });
  button?.classList.remove('cut');
  button?.classList.add('waiting');
  // A lesson line goes to its own language's model where the gateway serves several (PT lines, EN lines).
  const route = phrase ? phraseRoute(phrase, ui.voice.value, served) : { voice: ui.voice.value };
  connection.speak(id, text, { ...route, interrupt: ui.interrupt.checked, rate,
    cache: phrase ? true : undefined }); // the script's lines are shared (phrase cache); typed text is not marked
  log(`Asked to say “${shorten(text)}”${rate === 1 ? '' : ` at ${rate}×`} (${id})`);
}

// "Slower": the phrase's last recording played again slowly (no new synthesis), or said slowly if there is none.
function slower(phrase, button) {
  if (!phrase.lastId) {
    speak(phrase.text, button, { rate: SLOW_RATE, phrase });
    return;
  }
  if (!connection?.isOpen) {
    showError('Not connected yet: press Connect first.');
    return;
  }
  clearError();
  const id = `u${++counter}`;
  const { text } = phrase;
  utterances.set(id, { text, button, phrase, rate: SLOW_RATE, repeatOf: phrase.lastId,
                       spoken: new SpokenUtterance(id, text) });
  button.classList.remove('cut');
  button.classList.add('waiting');
  connection.repeat(phrase.lastId, id, { rate: SLOW_RATE, interrupt: ui.interrupt.checked });
  log(`Asked to repeat “${shorten(text)}” at ${SLOW_RATE}× (${id})`);
}

// --- karaoke and visemes ---------------------------------------------------------------------------

function audioReceiver() {
  return connection?.pc?.getReceivers().find((receiver) => receiver.track?.kind === 'audio') ?? null;
}

function rtpNow() {
  return heardRtp(audioReceiver(), audioContext?.outputLatency ?? 0);
}

// Show `entry` in the caption (and its phrase button), word by word as its timings arrive.
function showKaraoke(entry) {
  const targets = [ui.caption, entry.button?.querySelector('.text')].filter(Boolean);
  current = { spoken: entry.spoken, targets, word: -1 };
  for (const element of targets) renderWords(element, entry.text, entry.spoken.words);
  ui.caption.hidden = false;
  karaokeFrame ??= requestAnimationFrame(animateKaraoke);
}

function animateKaraoke() {
  karaokeFrame = null;
  if (!current) return;
  const rtp = rtpNow();
  if (current.spoken.heardToEnd(rtp)) { // its `done` came and its end has been heard: the face comes to rest
    stopKaraoke();
    avatar.rest();
    return;
  }
  const word = current.spoken.wordAt(rtp);
  if (word !== current.word) {
    current.word = word;
    for (const element of current.targets) highlightWord(element, word);
    karaokeTrail.push([current.spoken.id, word]);
  }
  avatar.viseme = current.spoken.visemeAt(rtp);
  karaokeFrame = requestAnimationFrame(animateKaraoke);
}

function stopKaraoke() {
  cancelAnimationFrame(karaokeFrame);
  karaokeFrame = null;
  for (const element of current?.targets ?? []) highlightWord(element, -1);
  current = null;
  avatar.viseme = null;
}

// The page's own playout of an utterance, told to the server (a metric) once its end has been heard.
function reportPlayed(entry, id, capMs) {
  const conn = connection;
  setTimeout(() => {
    if (connection !== conn) return; // that session is gone: a new one never heard of `id`
    const playedMs = Math.min(capMs, entry.spoken.playedMs(rtpNow()));
    if (conn.played(id, playedMs)) playedReports.push({ id, played_ms: Math.round(playedMs) });
  }, PLAYED_REPORT_DELAY_MS);
}

function finish(id) {
  const entry = utterances.get(id);
  entry?.button?.classList.remove('waiting', 'playing');
  utterances.delete(id);
  return entry;
}

function onMessage(msg) {
  switch (msg.type) {
    case 'ready': {
      const again = lessonUp; // up before, lost, and back (not a first offer that had to wait its turn)
      const waited = reconnector.active; // the error box still says why it had to try again
      reconnector.reset(); // up: a later loss starts from the first attempt
      lessonUp = true;
      fillVoices(msg.voices, msg.voice);
      // The script's lines, made while the engine has room, by the voice and language each line's speak names.
      for (const message of prefetchMessages(msg.voice, served)) connection?.send(message);
      setState('ready');
      if (waited) clearError();
      setNow(again ? 'Connected again. Your tutor is ready: pick a phrase to hear it!'
        : 'Your tutor is ready. Pick a phrase to hear it!', 'ready');
      log(`${again ? 'Reconnected: tutor' : 'Tutor'} ready (voice ${msg.voice}, buffer ${msg.jitter_buffer_ms} ms).`);
      break;
    }
    case 'queued':
      if (msg.position > 0) log(`${msg.id} waits behind ${msg.position} other(s).`);
      break;
    case 'started': {
      const entry = utterances.get(msg.id);
      entry?.button?.classList.replace('waiting', 'playing');
      if (entry) {
        entry.spoken.started(msg);
        showKaraoke(entry);
      }
      avatar.speak();
      ui.ttfa.textContent = msg.ttfa_ms == null ? '–' : `${Math.round(msg.ttfa_ms)} ms`;
      setNow(`Speaking: “${shorten(entry?.text ?? '…', 80)}”`, 'speaking');
      log(`${msg.id} started after ${Math.round(msg.ttfa_ms ?? 0)} ms.`);
      break;
    }
    case 'segment':
      utterances.get(msg.id)?.spoken.segment(msg);
      if (msg.index > 0) setNow(`Speaking: “${shorten(msg.text, 80)}”`, 'speaking');
      break;
    case 'words': {
      const entry = utterances.get(msg.id);
      if (!entry) break;
      entry.spoken.addWords(msg);
      if (current?.spoken === entry.spoken) {
        for (const element of current.targets) renderWords(element, entry.text, entry.spoken.words);
        current.word = -2; // re-applied on the next frame
      }
      break;
    }
    case 'visemes':
      utterances.get(msg.id)?.spoken.addVisemes(msg);
      break;
    case 'done': {
      const entry = finish(msg.id);
      if (entry) {
        entry.spoken.done(msg); // the karaoke (animateKaraoke) ends and the mouth rests once its end is heard
        reportPlayed(entry, msg.id, msg.audio_ms);
        if (entry.phrase && !entry.repeatOf) entry.phrase.lastId = msg.id; // now recorded on the server
      }
      ui.underruns.textContent = `${msg.underruns} (${Math.round(msg.underrun_ms)} ms)`;
      if (utterances.size === 0) setNow(`Finished (${(msg.audio_ms / 1000).toFixed(1)} s). Now you try!`, 'done');
      log(`${msg.id} done: ${msg.audio_ms} ms of audio, ${msg.underruns} underrun(s).`);
      break;
    }
    case 'cancelled': {
      const entry = finish(msg.id);
      if (entry && current?.spoken === entry.spoken) {
        stopKaraoke();
        avatar.rest(); // the rest of it will not come
      }
      if (entry?.spoken.startedAt != null) reportPlayed(entry, msg.id, msg.played_ms);
      if (utterances.size === 0) setNow('Stopped.', 'cancelled');
      log(`${msg.id} cancelled${msg.heard_text ? ` after “${shorten(msg.heard_text)}”` : ''}.`);
      break;
    }
    case 'pong':
      if (msg.rtt_ms != null) ui.rtt.textContent = `${msg.rtt_ms.toFixed(0)} ms`;
      break;
    case 'error': {
      const entry = msg.id ? finish(msg.id) : null;
      if (entry && current?.spoken === entry.spoken) { // it failed while being heard: nothing more of it comes
        stopKaraoke();
        avatar.rest();
      }
      if (entry?.repeatOf && msg.code === 'unknown_id') { // the server no longer has it: say it slowly instead
        entry.phrase.lastId = null;
        speak(entry.text, entry.button, { rate: entry.rate, phrase: entry.phrase });
        break;
      }
      showError(eventErrorMessage(msg));
      if (utterances.size === 0 && ui.now.dataset.kind === 'speaking') setNow('Stopped.', 'cancelled');
      break;
    }
    default:
      break; // newer servers may send more; ignore what we do not know
  }
}

// --- live panel ------------------------------------------------------------------------------------

async function refreshStats() {
  const pc = connection?.pc;
  if (!pc) return;
  const entry = await inboundAudio(pc).catch(() => null);
  if (!entry) return;
  lastStats = summarize(entry);
  ui.jb.textContent = lastStats.jitterBufferMs == null ? '–' : `${lastStats.jitterBufferMs.toFixed(0)} ms`;
  ui.packets.textContent = String(lastStats.packetsReceived);
  ui.lost.textContent = String(lastStats.packetsLost);
  ui.concealed.textContent = String(lastStats.concealedSamples);
}

// --- start-up --------------------------------------------------------------------------------------

async function loadVoices() {
  try {
    const response = await fetch(`${location.origin}/v1/voices`);
    if (!response.ok) return;
    const { voices, default: chosen, models = [], languages = [] } = await response.json();
    served = { languages, voiceLanguages: Object.fromEntries(models.map((m) => [m.name, m.language])) };
    fillVoices(voices, chosen);
  } catch {
    // the voices come again with `ready`; a failure here is not worth a message
  }
}

renderPhrases(ui.phrases, (phrase, button) => speak(phrase.text, button, { phrase }), slower);
ui.connect.addEventListener('click', connect);
ui.disconnect.addEventListener('click', disconnect);
ui.speak.addEventListener('click', () => {
  const text = ui.text.value.trim();
  if (text) speak(text);
  else showError('There is nothing to say yet: type a sentence first.');
});
ui.text.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && (event.ctrlKey || event.metaKey) && !ui.speak.disabled) ui.speak.click();
});
ui.stop.addEventListener('click', () => {
  connection?.cancel();
  log('Stop pressed.');
});
window.addEventListener('pagehide', () => {
  reconnector.reset();
  connection?.close({ keepalive: true });
});
setState('disconnected');
loadVoices();
loadProtocolSchema().then(() => {
  const max = jitterBufferMaxMs();
  if (max === null) return;
  ui.jitter.max = String(max);
  $('jitter-max').textContent = String(max);
});

// For tests and the curious (browser console): the live objects behind the page.
window.__avatar = avatar;
window.__app = {
  get connection() { return connection; },
  get reconnectAttempt() { return reconnector.attempt; },
  get pc() { return connection?.pc ?? null; },
  get lastStats() { return lastStats; },
  get karaoke() { return current; },
  karaokeTrail,
  playedReports,
  rtpNow,
  speak,
};
