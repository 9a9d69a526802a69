// The tutor's mouth: shaped by the viseme being heard when the server sent visemes (set `viseme` each frame),
// else following the loudness of the incoming speech: an AnalyserNode on the remote stream, read once per
// animation frame. The analyser is not connected to the speakers; the <audio> element plays. Between utterances
// (from `rest`, at an utterance's heard end or its cancel, until the next `speak`) the mouth closes and stays
// closed, whatever the stream still carries.

const QUIET_DB = -50; // at or below: mouth closed
const LOUD_DB = -18; // at or above: mouth fully open
const ATTACK = 0.6; // opening follows quickly...
const RELEASE = 0.25; // ...closing a little slower, so the mouth does not flicker
const VISEME_FOLLOW = 0.55; // visemes change every ~60 ms: follow fast, but not in one frame

// Oculus-15 visemes as mouth shapes: how open (0..1) and how wide (-1 rounded .. 1 spread).
export const VISEME_SHAPES = {
  sil: [0, 0], PP: [0.02, 0], FF: [0.15, 0.2], TH: [0.22, 0.1], DD: [0.3, 0.2], kk: [0.35, 0.1],
  CH: [0.3, -0.5], SS: [0.15, 0.6], nn: [0.25, 0.2], RR: [0.3, -0.4], aa: [0.9, 0.2], E: [0.6, 0.6],
  I: [0.4, 0.8], O: [0.7, -0.7], U: [0.35, -0.9],
};

export class Avatar {
  constructor(svg, mouth) {
    this.svg = svg;
    this.mouthPath = mouth;
    this.mouth = 0; // current openness, 0..1
    this.width = 0; // current spread, -1 (rounded) .. 1
    this.maxMouth = 0; // largest openness seen (for tests and curiosity)
    this.viseme = null; // the viseme heard now (set by the page each frame), null: follow the loudness
    this.resting = true; // no utterance being heard: the mouth closes and stays closed
    this.visemeFrames = 0; // frames drawn from a viseme (for tests)
    this.visemesShown = new Set(); // which visemes were drawn (for tests)
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

  /** An utterance is being heard: follow its visemes or loudness. */
  speak() {
    this.resting = false;
  }

  /** No utterance is being heard any more: close the mouth (over a few frames) and keep it closed. */
  rest() {
    this.resting = true;
    this.viseme = null;
  }

  detach() {
    cancelAnimationFrame(this._frame);
    this._source?.disconnect();
    this._source = this._analyser = null;
    this.mouth = 0;
    this.width = 0;
    this.rest();
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
    const shape = this.viseme && !this.resting ? VISEME_SHAPES[this.viseme] : null;
    if (shape) {
      // The loudness still scales the shape a little, so a quiet syllable is not drawn wide open.
      const level = 0.6 + 0.4 * this._level();
      this.mouth += (shape[0] * level - this.mouth) * VISEME_FOLLOW;
      this.width += (shape[1] - this.width) * VISEME_FOLLOW;
      this.visemeFrames += 1;
      this.visemesShown.add(this.viseme);
    } else {
      const target = this.resting ? 0 : this._level();
      this.mouth += (target - this.mouth) * (target > this.mouth ? ATTACK : RELEASE);
      this.width += (0 - this.width) * RELEASE;
    }
    if (this.mouth < 0.005) this.mouth = 0;
    this.maxMouth = Math.max(this.maxMouth, this.mouth);
    this._draw(this.mouth, this.width);
    this._frame = requestAnimationFrame(() => this._tick());
  }

  // A smile that opens: the upper lip barely moves, the lower lip drops with the level; a wide viseme pulls
  // the corners out, a rounded one in.
  _draw(open, width = 0) {
    const upper = 144 - open * 6;
    const lower = 148 + open * 34;
    const corner = 80 + open * 4 - width * 6; // corners come in a little as the mouth opens
    this.mouthPath.setAttribute('d',
      `M${corner} 140 Q100 ${upper} ${200 - corner} 140 Q100 ${lower} ${corner} 140 Z`);
    this.svg.dataset.mouth = open.toFixed(3);
    this.svg.classList.toggle('talking', open > 0.05);
  }
}
