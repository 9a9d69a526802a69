"""orpheus-gateway: real-time WebRTC voice gateway streaming Orpheus TTS from one shared vLLM engine."""

__version__ = "0.1.0"
