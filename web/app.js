// The lesson page: wires the buttons to a TutorConnection, the remote audio to the <audio> element and
// the avatar, and the server's events to the phrase highlight, the karaoke (the word being heard), the
// avatar's visemes, the status line and the live panel.

import { Avatar } from './avatar.js';
import { TutorConnection } from './connection.js';
import { SpokenUtterance, heardRtp, highlightWord, renderWords } from './karaoke.js';
import { SLOW_RATE, renderPhrases } from './lesson.js';
import { connectErrorMessage, eventErrorMessage } from './messages.js';
import { jitterBufferMaxMs, loadProtocolSchema } from './protocol.js';
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
let audioContext = null;
let statsTimer = null;
let lastStats = null;
let counter = 0;
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

  const conn = new TutorConnection();
  connection = conn;
  conn.addEventListener('track', ({ detail }) => onTrack(detail.stream));
  conn.addEventListener('message', ({ detail }) => onMessage(detail.msg));
  conn.addEventListener('state', ({ detail }) => onPeerState(conn, detail.state));
  conn.addEventListener('closed', ({ detail }) => {
    if (connection !== conn) return;
    showError(detail.reason === 'silent'
      ? 'The tutor stopped answering (the server may have restarted). Press Connect to continue.'
      : 'The lesson connection was closed by the server. Press Connect to continue.');
    teardown();
  });
  try {
    await conn.connect({ voice: ui.voice.value, jitterBufferMs: jitter });
  } catch (error) {
    if (connection !== conn) return; // the student pressed Disconnect meanwhile
    showError(connectErrorMessage(error));
    conn.close();
    teardown();
    return;
  }
  if (connection !== conn) return;
  if (document.body.dataset.state === 'connecting') setState('connected'); // `ready` may not be here yet
  log(`Session ${conn.sessionId.slice(0, 8)} opened; waiting for the tutor…`);
  statsTimer = setInterval(refreshStats, STATS_INTERVAL_MS);
}

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
    showError('The audio connection failed. Check your network and press Connect again.');
    conn.close();
    teardown();
  } else if (state === 'disconnected') {
    log('The connection is unstable; trying to recover…', 'error');
  }
}

async function disconnect() {
  const conn = connection;
  teardown();
  setNow('Disconnected. Press “Connect” to continue the lesson.');
  log('Disconnected.');
  await conn?.close();
}

// Back to the idle page: no session, no highlight, no sound.
function teardown() {
  connection = null;
  clearInterval(statsTimer);
  statsTimer = null;
  avatar.detach();
  ui.audio.srcObject = null;
  stopKaraoke();
  for (const id of utterances.keys()) finish(id);
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
  button?.classList.add('waiting');
  connection.speak(id, text, { voice: ui.voice.value, interrupt: ui.interrupt.checked, rate });
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
  setTimeout(() => {
    const playedMs = Math.min(capMs, entry.spoken.playedMs(rtpNow()));
    if (connection?.played(id, playedMs)) playedReports.push({ id, played_ms: Math.round(playedMs) });
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
    case 'ready':
      fillVoices(msg.voices, msg.voice);
      setState('ready');
      setNow('Your tutor is ready. Pick a phrase to hear it!', 'ready');
      log(`Tutor ready (voice ${msg.voice}, buffer ${msg.jitter_buffer_ms} ms).`);
      break;
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
      if (entry && current?.spoken === entry.spoken) stopKaraoke();
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
    const { voices, default: chosen } = await response.json();
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
window.addEventListener('pagehide', () => connection?.close({ keepalive: true }));
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
  get pc() { return connection?.pc ?? null; },
  get lastStats() { return lastStats; },
  get karaoke() { return current; },
  karaokeTrail,
  playedReports,
  rtpNow,
  speak,
};
