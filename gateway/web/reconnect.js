// Coming back by itself after the session was lost (a silent or restarted server, a failed network path): the one
// place that says when to try again, how long to wait and when to stop. The page decides what a loss is and opens
// the new session; this module only counts the attempts and keeps the clock.
//
// Emits `waiting` {attempt, maxAttempts, delayMs} when an attempt is scheduled, then `attempt` {attempt,
// maxAttempts} when it is due.

import { GatewayError } from './connection.js';

const BASE_DELAY_MS = 1000; // the first attempt waits ~1 s, then 2, 4, 8 ...
const MAX_DELAY_MS = 15000; // ... up to this
const MAX_ATTEMPTS = 6; // ~45 s of trying in all, then the student is asked to press Connect
// Each wait is shortened by up to this fraction at random, so that the pages one server restart dropped together
// do not all come back in the same instant.
const JITTER = 0.3;
// A server's Retry-After is honoured up to this; a larger one (a misconfigured proxy) would leave the page hanging.
const MAX_RETRY_AFTER_MS = 60000;

// The session-ending `error` codes after which coming back is not wanted: the server closed a lesson left idle or
// one that reached its time limit on purpose, and reopening it by itself would defeat the limit.
const FINAL_END_CODES = new Set(['idle_timeout', 'session_time_limit']);

/** The wait before attempt `attempt` (1, 2, ...): capped exponential backoff with jitter, never earlier than the
 *  server's `retryAfterS` when the failure came with one (jitter then goes above it, not below). */
export function backoffDelayMs(attempt, { baseMs = BASE_DELAY_MS, capMs = MAX_DELAY_MS, retryAfterS = null,
                                          random = Math.random } = {}) {
  const spread = random();
  const backoff = Math.min(capMs, baseMs * 2 ** (attempt - 1)) * (1 - JITTER * spread);
  if (retryAfterS == null || !(retryAfterS >= 0)) return backoff;
  return Math.max(backoff, Math.min(MAX_RETRY_AFTER_MS, retryAfterS * 1000) * (1 + JITTER * spread));
}

/** Whether a failed connect attempt is worth repeating: the server or the network was (maybe briefly) unable.
 *  A refusal about the request itself (400 bad voice, 401/403 access, 404, 413) would be refused again. */
export function isRetryable(error) {
  if (error instanceof GatewayError) return error.status >= 500 || error.status === 408 || error.status === 429;
  if (error instanceof TypeError) return true; // fetch: the server could not be reached
  return error?.name === 'TimeoutError'; // the offer got no answer in time
}

/** Whether a session the server ended with `error` code `code` (none: it just went away) should come back. */
export function reconnectsAfter(code) {
  return !FINAL_END_CODES.has(code);
}

// Tests (and anyone curious) can make the waits shorter or the attempts fewer: `?reconnect_base_ms=200&
// reconnect_attempts=2`, next to the page's `?token=`.
function settingsFromQuery() {
  const query = new URLSearchParams(location.search);
  const number = (name, fallback) => {
    const value = Number(query.get(name) ?? NaN);
    return Number.isFinite(value) && value >= 0 ? value : fallback;
  };
  return { baseMs: number('reconnect_base_ms', BASE_DELAY_MS),
           maxAttempts: Math.floor(number('reconnect_attempts', MAX_ATTEMPTS)) };
}

/** The attempts of one loss, until a session is up again (`reset`), the student takes over (`reset`), or none is
 *  left (`schedule` answers false). */
export class Reconnector extends EventTarget {
  constructor({ baseMs, capMs = MAX_DELAY_MS, maxAttempts } = settingsFromQuery()) {
    super();
    this.baseMs = baseMs;
    this.capMs = capMs;
    this.maxAttempts = maxAttempts;
    this.attempt = 0; // attempts made (or scheduled) since the loss; 0: not reconnecting
    this._timer = null;
  }

  /** Between a loss and the next session that is up. */
  get active() {
    return this.attempt > 0;
  }

  /** Schedule the next attempt (`retryAfterS`: the server's word on when to ask again); false when none is left. */
  schedule(retryAfterS = null) {
    clearTimeout(this._timer);
    if (this.attempt >= this.maxAttempts) return false;
    const attempt = ++this.attempt;
    const delayMs = backoffDelayMs(attempt, { baseMs: this.baseMs, capMs: this.capMs, retryAfterS });
    const detail = { attempt, maxAttempts: this.maxAttempts };
    this._timer = setTimeout(() => {
      this._timer = null;
      this.dispatchEvent(new CustomEvent('attempt', { detail }));
    }, delayMs);
    this.dispatchEvent(new CustomEvent('waiting', { detail: { ...detail, delayMs } }));
    return true;
  }

  /** Stop: a session is up again, or the student pressed Connect or Disconnect. A pending attempt never comes. */
  reset() {
    clearTimeout(this._timer);
    this._timer = null;
    this.attempt = 0;
  }
}
