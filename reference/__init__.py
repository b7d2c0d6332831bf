"""kvspec.reference: a reference implementation of the KV-cache block lifecycle."""
