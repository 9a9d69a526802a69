// The tutor's mouth follows the loudness of the incoming speech: an AnalyserNode on the remote stream,
// read once per animation frame. The analyser is not connected to the speakers; the <audio> element plays.

const QUIET_DB = -50; // at or below: mouth closed
const LOUD_DB = -18; // at or above: mouth fully open
const ATTACK = 0.6; // opening follows quickly...
const RELEASE = 0.25; // ...closing a little slower, so the mouth does not flicker

export class Avatar {
  constructor(svg, mouth) {
    this.svg = svg;
    this.mouthPath = mouth;
    this.mouth = 0; // current openness, 0..1
    this.maxMouth = 0; // largest openness seen (for tests and curiosity)
    this._analyser = null;
    this._source = null;
    this._samples = null;
    this._frame = null;
    this._draw(0);
  }

  /** Follow `stream`'s level through `audioContext`. */
  attach(stream, audioContext) {
    this.detach();
    this._source = audioContext.createMediaStreamSource(stream);
    this._analyser = audioContext.createAnalyser();
    this._analyser.fftSize = 1024; // ~21 ms at 48 kHz: about one Opus frame
    this._samples = new Float32Array(this._analyser.fftSize);
    this._source.connect(this._analyser);
    this._frame = requestAnimationFrame(() => this._tick());
  }

  detach() {
    cancelAnimationFrame(this._frame);
    this._source?.disconnect();
    this._source = this._analyser = null;
    this.mouth = 0;
    this._draw(0);
  }

  _level() {
    this._analyser.getFloatTimeDomainData(this._samples);
    let sum = 0;
    for (const s of this._samples) sum += s * s;
    const rms = Math.sqrt(sum / this._samples.length);
    const db = 20 * Math.log10(rms + 1e-9);
    return Math.min(1, Math.max(0, (db - QUIET_DB) / (LOUD_DB - QUIET_DB)));
  }

  _tick() {
    if (!this._analyser) return;
    const target = this._level();
    this.mouth += (target - this.mouth) * (target > this.mouth ? ATTACK : RELEASE);
    if (this.mouth < 0.005) this.mouth = 0;
    this.maxMouth = Math.max(this.maxMouth, this.mouth);
    this._draw(this.mouth);
    this._frame = requestAnimationFrame(() => this._tick());
  }

  // A smile that opens: the upper lip barely moves, the lower lip drops with the level.
  _draw(open) {
    const upper = 144 - open * 6;
    const lower = 148 + open * 34;
    const corner = 80 + open * 4; // corners come in a little as the mouth opens
    this.mouthPath.setAttribute('d',
      `M${corner} 140 Q100 ${upper} ${200 - corner} 140 Q100 ${lower} ${corner} 140 Z`);
    this.svg.dataset.mouth = open.toFixed(3);
    this.svg.classList.toggle('talking', open > 0.05);
  }
}
