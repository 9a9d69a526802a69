// Human wording for what can go wrong: a student should read what happened and what to do,
// not an error code. The server's own message is kept where it adds something useful.

import { GatewayError } from './connection.js';

/** Why connecting failed (the offer's HTTP error, or no server at all). */
export function connectErrorMessage(error) {
  if (error instanceof GatewayError) {
    const { status, code, message } = error;
    if (status === 503 && code === 'at_capacity') {
      return 'The teacher is busy (server at capacity). Please try again in a moment.';
    }
    if (status === 503) return 'The tutor is still getting ready. Please try again in a moment.';
    if (status === 401) return 'Access refused: please sign in again (the server did not accept your login).';
    if (status === 403) return 'Access refused: your account is not allowed to use the tutor.';
    if (code === 'unknown_voice') return `That voice is not available. ${message}`;
    if (code === 'invalid_jitter_buffer') return `The audio buffer setting was refused: ${message}`;
    if (status === 413) return 'The request was too large for the server.';
    return `Could not connect (${status}): ${message}`;
  }
  if (error instanceof TypeError) return 'Could not reach the server. Check your internet connection and try again.';
  if (error?.name === 'TimeoutError') return 'The server did not answer in time. Please try again in a moment.';
  return `Could not connect: ${error?.message ?? error}`;
}

/** Why a session that was up got lost (`reason`: 'silent' or 'closed' from TutorConnection, or 'failed' for the
 *  peer; `code`: the `error` the server ended it with, if any). The page adds what happens next. */
export function lostMessage({ reason, code }) {
  if (reason === 'silent') return 'The tutor stopped answering (the server may have restarted).';
  if (reason === 'failed') return 'The audio connection failed (check your network).';
  if (code === 'shutting_down') return 'The tutor is restarting for maintenance.';
  if (code === 'heartbeat_timeout') return 'The connection to the tutor was lost.';
  return 'The lesson connection was closed by the server.';
}

/** An `error` event from the data channel. */
export function eventErrorMessage({ code, message }) {
  switch (code) {
    case 'unknown_voice': return `That voice is not available. ${message}`;
    case 'queue_full': return 'Too many sentences are waiting. Press Stop or wait a moment.';
    case 'text_too_long': return `That text is too long to say in one go (${message}).`;
    case 'empty_text': return 'There is nothing to say yet: type a sentence first.';
    case 'engine_unavailable': return 'The tutor’s voice is not ready right now. Please try again in a moment.';
    case 'idle_timeout': return 'The lesson was closed after a long pause. Press Connect to continue.';
    case 'heartbeat_timeout': return 'The connection to the tutor was lost. Press Connect to continue.';
    case 'session_time_limit': return 'This lesson reached its time limit. Press Connect to start a new one.';
    case 'invalid_rate': return `That speed is not possible: ${message}`;
    case 'invalid_range': return `Those words are not in the phrase: ${message}`;
    case 'rate_limited': return 'That was a lot at once: please wait a second between sentences.';
    case 'at_capacity': return 'The teacher is busy (server at capacity). Please try again in a moment.';
    case 'engine_dead': return 'The tutor’s voice stopped and is restarting. Please say that again in a moment.';
    case 'engine_rejected': return 'The tutor could not say that sentence. Please try a shorter one.';
    case 'shutting_down': return 'The tutor is restarting for maintenance. Press Connect again in a minute.';
    default: return `The tutor could not do that: ${message}`;
  }
}
