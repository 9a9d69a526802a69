// The session protocol's bounds, read from the JSON Schema the server generates from its message types
// (gateway/rtc/protocol.py -> /static/protocol.schema.json): the page states no limit of its own.

let schema = null;

/** Load the schema once; null when it cannot be had (the server still checks every message). */
export async function loadProtocolSchema(baseUrl = '') {
  if (schema) return schema;
  try {
    const response = await fetch(`${baseUrl}/static/protocol.schema.json`);
    if (response.ok) schema = await response.json();
  } catch {
    schema = null;
  }
  return schema;
}

/** The largest jitter buffer an offer may ask for, in ms (null when the schema is not loaded). */
export function jitterBufferMaxMs() {
  const field = schema?.$defs?.Offer?.properties?.jitter_buffer_ms;
  const integer = field?.anyOf?.find((option) => option.type === 'integer') ?? field;
  return typeof integer?.maximum === 'number' ? integer.maximum : null;
}
