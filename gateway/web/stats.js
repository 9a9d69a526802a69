// The browser's own view of the incoming audio (RTCInboundRtpStreamStats): what the student's
// jitter buffer, losses and concealment look like, independent of what the server reports.

/** The inbound-rtp audio entry of `pc.getStats()`, or null before any audio stream exists. */
export async function inboundAudio(pc) {
  const report = await pc.getStats();
  for (const entry of report.values()) {
    if (entry.type === 'inbound-rtp' && entry.kind === 'audio') return entry;
  }
  return null;
}

/** The figures the live panel shows, with the jitter buffer as an average delay in ms. */
export function summarize(entry) {
  const emitted = entry.jitterBufferEmittedCount ?? 0;
  return {
    packetsReceived: entry.packetsReceived ?? 0,
    packetsLost: entry.packetsLost ?? 0,
    concealedSamples: entry.concealedSamples ?? 0,
    totalSamplesReceived: entry.totalSamplesReceived ?? 0,
    jitterBufferMs: emitted > 0 ? (1000 * entry.jitterBufferDelay) / emitted : null,
  };
}
