"""One SNAC decoder shared by every gateway process of a host, over a Unix socket (`serve --workers` with
`--snac-placement shared`): the protocol (`wire`), the server that decodes for every connection (`server`) and the
client each gateway process uses in place of its own decoder (`client`). Why one process:
docs/decisions/shared-snac-process.md.
"""
