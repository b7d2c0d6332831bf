"""Building kvspec from a checkout leaves the checkout as it was (issue #34): ``pip install .``
and ``pip wheel .`` write no ``build/`` and no ``kvspec.egg-info`` into it (``setup.py`` removes
what its run made). Built from a copy of the checkout's files, pure Python (the mypyc build is
``test_wheel.py``'s), so that it takes seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_wheel import _copy_checkout


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


def test_building_a_wheel_leaves_the_checkout_clean(tmp_path: Path) -> None:
    source, dist = tmp_path / "kvspec", tmp_path / "dist"
    _copy_checkout(source)
    before = _tree(source)
    env = dict(os.environ, KVSPEC_PURE_PYTHON="1")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(dist), str(source)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert list(dist.glob("kvspec-*.whl"))
    left = sorted(_tree(source) - before)
    assert not left, f"the build left {left[:10]} in the checkout"
