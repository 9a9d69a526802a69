"""Process supervision: `serve --workers N` (gateway workers sharing a port, one `vllm serve`, one shared SNAC
process), children that die with their supervisor, sessions routed to the worker that owns them.

Owns: `supervisor` (starts, restarts and stops the children), `workers` (a worker process's entry point and
config), `forwarding` (requests passed to the owning or a free worker, merged metrics), `addressing` (the env,
socket and header names the processes share), `snac_process` (the shared SNAC process: the codec server and its
decode metrics), `vllm_cli` (the `vllm serve` it starts: vLLM's own command line), `lifecycle` (waiting for the
stop signal).
May import: `gateway.edge` (the app each worker serves), everything below it. Nothing imports it but the
command line.
"""
