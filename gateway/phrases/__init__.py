"""The phrase cache: sentences spoken once and replayed to every session, worker and host that says them again.

A sentence's cache key (`key.PhraseKey`) holds everything that changes its sound: the checkpoint's identity (model
and codec paths with a digest of their config files and weight listings), the voice, the normalised text, the
sampling settings, the stored rate and the seed policy. An entry (`entry.PhraseEntry`) is the sentence's 24 kHz PCM
as synthesised, its word timings and visemes, under a checksum: a corrupt entry is dropped and made again, never
played. Entries live in a store: `disk.DiskStore` (SQLite in WAL mode, shared by the `serve --workers` processes of
a host, bounded in bytes with least-recently-used eviction) or `redis_store.RedisStore` (`--phrase-cache-url`, many
hosts; Redis down means misses and a metric, never a failed utterance). `cache.PhraseCache` puts them together with
the deployment's policy (`--phrase-cache off|marked|all`), single flight (concurrent first requests for a key
generate it once; the others follow the one stream; across processes and hosts through a board in the store:
`board`, `disk_board.DiskBoard`, `redis_board.RedisBoard`) and prefetch (only while the engine has room), and
`speech.cached_sentences` turns an utterance's sentences into audio: hits from the store, misses from the
synthesizer.

Owns: `PhraseKey`, `PhraseEntry`, `DiskStore`, `RedisStore`, `PhraseCache`, `Flight`, `FlightBoard`, `DiskBoard`,
`RedisBoard`, `cached_sentences`.
May import: `gateway.speech` (the synthesizer), `gateway.timing` (word and viseme types), `gateway.service`
(metrics, admission), `gateway.config`, `gateway.orpheus`, numpy, sqlite3, redis. Nothing about sessions, playout or
HTTP routes: `gateway.rtc` and `gateway.edge` call it.
"""
