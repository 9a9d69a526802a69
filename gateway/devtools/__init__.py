"""Development tools: random-weight Orpheus-shaped models and SNAC for tests and benchmarks (`devmodels`,
`make-test-model`), reference SNAC decodes the streaming decoder must equal (`snac_reference`), and a headless
WebRTC peer speaking the session protocol (`client.HeadlessPeer`).

Owns: test models, reference decodes and the headless client.
May import: `gateway.rtc.protocol` and the layers below; never imported by the gateway's serving code.
"""
