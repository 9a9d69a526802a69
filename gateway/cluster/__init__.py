"""Process supervision: `serve --workers N` (gateway workers sharing a port, one `vllm serve`, one shared SNAC
process), children that die with their supervisor, sessions routed to the worker that owns them.

Owns: `workers` (supervisor, worker entry point, request forwarding, merged metrics), `snac_process` (the
shared SNAC process: the codec server and its decode metrics), `vllm_cli` (the `vllm serve` it starts: vLLM's
own command line), `lifecycle` (waiting for the stop signal).
May import: `gateway.edge` (the app each worker serves), everything below it. Nothing imports it but the
command line.
"""
