"""fleetctl: operate GPU inference hosts that run SGLang, over SSH."""

__version__ = "0.1.0"
