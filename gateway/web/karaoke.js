// Word timings and visemes on this page's own playout clock, and the karaoke view of a phrase.
//
// The server stamps each sentence's `words`/`visemes` with the RTP timestamp of its first sample. The browser's
// receiver says which RTP timestamp it last played out and when (getSynchronizationSources(): rtpTimestamp,
// timestamp), so "what is heard now" is that timestamp plus the time since, whatever the jitter buffer holds.
// Without it (an older browser, or no rtp_timestamp), times count from the arrival of the sentence's `segment`.

const RTP_PER_MS = 48; // the audio track's RTP clock: 48 kHz

/** Signed difference a - b of two 32-bit RTP timestamps (they wrap). */
export function rtpDelta(a, b) {
  return (a - b) | 0;
}

/** The RTP timestamp being heard now on `receiver`'s track, or null when the browser cannot say. */
export function heardRtp(receiver, outputLatencyS = 0) {
  const sources = receiver?.getSynchronizationSources?.() ?? [];
  const source = sources[0];
  if (!source || typeof source.rtpTimestamp !== 'number' || typeof source.timestamp !== 'number') return null;
  // The spec's clock is performance.timeOrigin + performance.now(); accept one relative to timeOrigin too.
  const now = source.timestamp > 1e11 ? performance.timeOrigin + performance.now() : performance.now();
  const sinceMs = now - source.timestamp - outputLatencyS * 1000;
  return (source.rtpTimestamp + Math.round(sinceMs * RTP_PER_MS)) >>> 0;
}

/** What one utterance says and when: its words and visemes on the RTP clock (or the page's, as a fallback). */
export class SpokenUtterance {
  constructor(id, text) {
    this.id = id;
    this.text = text;
    this.words = []; // by utterance word index: {text, char_start, char_end, rtp, local, end/localEnd}
    this.visemes = []; // {viseme, rtp, rtpEnd, local, localEnd}
    this.segmentAt = new Map(); // sentence index -> performance.now() at its `segment` (the fallback clock)
    this.startRtp = null; // `started`: its first sample
    this.startedAt = null;
    this.audioMs = null; // `done`: how long it is
  }

  started(msg) {
    this.startRtp = msg.rtp_timestamp ?? null;
    this.startedAt = performance.now();
  }

  done(msg) {
    this.audioMs = msg.audio_ms;
  }

  /** Whether its `done` came and its last sample has been heard (at `rtp`, else at `local`). */
  heardToEnd(rtp, local = performance.now()) {
    return this.audioMs != null && this.playedMs(rtp, local) >= this.audioMs;
  }

  segment(msg) {
    this.segmentAt.set(msg.index, performance.now());
  }

  // Both clocks for a span of a sentence: RTP from the sentence's timestamp, local from its segment's arrival.
  _span(msg, startMs, durationMs) {
    const offset = startMs - msg.start_ms;
    const local0 = this.segmentAt.get(msg.index) ?? performance.now();
    const rtp = msg.rtp_timestamp == null ? null : (msg.rtp_timestamp + offset * RTP_PER_MS) >>> 0;
    return {
      rtp, rtpEnd: rtp == null ? null : (rtp + durationMs * RTP_PER_MS) >>> 0,
      local: local0 + offset, localEnd: local0 + offset + durationMs,
    };
  }

  addWords(msg) {
    msg.words.forEach((word, i) => {
      this.words[msg.first_word + i] = { ...word, ...this._span(msg, word.start_ms, word.duration_ms) };
    });
  }

  addVisemes(msg) {
    for (const v of msg.visemes) this.visemes.push({ viseme: v.viseme, ...this._span(msg, v.start_ms, v.duration_ms) });
  }

  // Is `span` at or before the position (`rtp` on the RTP clock, else `local`)?
  static _reached(span, rtp, local) {
    return rtp != null && span.rtp != null ? rtpDelta(rtp, span.rtp) >= 0 : local >= span.local;
  }

  static _inside(span, rtp, local) {
    return rtp != null && span.rtp != null
      ? rtpDelta(rtp, span.rtp) >= 0 && rtpDelta(rtp, span.rtpEnd) < 0
      : local >= span.local && local < span.localEnd;
  }

  /** Index of the word being heard (the last one started), or -1 before the first. */
  wordAt(rtp, local = performance.now()) {
    let current = -1;
    this.words.forEach((word, i) => {
      if (word && SpokenUtterance._reached(word, rtp, local)) current = i;
    });
    return current;
  }

  /** The viseme being heard, or null between words (the amplitude drives the mouth then). */
  visemeAt(rtp, local = performance.now()) {
    const hit = this.visemes.find((v) => SpokenUtterance._inside(v, rtp, local));
    return hit ? hit.viseme : null;
  }

  /** Milliseconds of this utterance played out here so far. */
  playedMs(rtp, local = performance.now()) {
    if (rtp != null && this.startRtp != null) return Math.max(0, rtpDelta(rtp, this.startRtp) / RTP_PER_MS);
    return this.startedAt == null ? 0 : local - this.startedAt;
  }
}

/** Render `text` in `element` with one <span class="word" data-word="i"> per known word (offsets from the server). */
export function renderWords(element, text, words) {
  const parts = [];
  let at = 0;
  words.forEach((word, index) => {
    if (!word || word.char_start < at || word.char_end > text.length) return;
    if (word.char_start > at) parts.push(document.createTextNode(text.slice(at, word.char_start)));
    const span = document.createElement('span');
    span.className = 'word';
    span.dataset.word = String(index);
    span.textContent = text.slice(word.char_start, word.char_end);
    parts.push(span);
    at = word.char_end;
  });
  if (at < text.length) parts.push(document.createTextNode(text.slice(at)));
  element.replaceChildren(...parts);
}

/** Mark word `current` in `element` (and those before it as said). */
export function highlightWord(element, current) {
  for (const span of element.querySelectorAll('.word')) {
    const index = Number(span.dataset.word);
    span.classList.toggle('current', index === current);
    span.classList.toggle('said', index < current);
  }
}
