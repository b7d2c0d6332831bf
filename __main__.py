"""python -m kvspec: the command line."""

from kvspec.cli import main

raise SystemExit(main())
