"""Speech synthesis: text -> prompt ids -> the shared vLLM engine's token ids -> SNAC codes -> 24 kHz PCM.

Owns: the engine lifecycle (`engine.OrpheusEngine` in-process, `remote.RemoteEngine` over `vllm serve`), SNAC
decoding (`snac`: the exact streaming decoder and its fast-start bridge, a package; `stream_decoder`: its worker
thread, batching every sentence of a process; `step_timing`: when that thread steps; `first_audio`: when, and from
which of the two, a sentence's first audio goes out; `codec`: one decoder shared over a Unix socket, its wire
format, server and client; `decoder`: the `Decoder` protocol both the local decoder and the codec client meet),
`synthesizer.Synthesizer`, the one interface every front end uses, its request rules and sentence plan
(`utterance_text`: `check_text`, `choose_voice`, `voiced_sentences`), checkpoint checks (`checkpoints`), language
spans (`language_spans`), and the layer's exceptions (`errors`).
May import: `gateway.orpheus` (model facts), `gateway.model_table`, `gateway.config`, vllm, torch, snac, numpy,
aiohttp (the remote engine). Nothing about sessions, playout or HTTP routes: those are above it.
"""
