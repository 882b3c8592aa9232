"""diloco: geo-distributed, low-communication training (core library)."""

__version__ = "0.1.0"
