"""Command-line entry point for kvspec (placeholder; to be replaced)."""

from __future__ import annotations

import sys

USAGE = "usage: kvspec <command> [args...]\n\ncommands:\n  demo    run the demo\n"


def main(argv: list[str] | None = None) -> int:
    """Print usage and return 2 (placeholder until the real CLI lands)."""
    del argv
    sys.stderr.write(USAGE)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
