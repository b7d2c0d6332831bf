"""python -m kvspec: the command line.

Ctrl-C while Python is still importing the command line ends it as Ctrl-C inside a command does
(``cli.main``): exit 130 and one line on stderr, not a traceback."""

import sys

try:
    from kvspec.cli import main
except KeyboardInterrupt:
    sys.stderr.write("kvspec: interrupted\n")
    raise SystemExit(130) from None

raise SystemExit(main())
