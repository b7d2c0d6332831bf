"""Adapters of third-party engines (each importable only in its own virtual environment)."""
