"""kvspec: an executable specification of the KV-cache block lifecycle, with conformance checks."""

__version__ = "0.1.0"
