"""docs/your-engine.md, run as written: every fenced shell block marked ``<!-- run -->`` (or
``<!-- run: exit N -->``) is executed, in order, by ``bash`` in a copy of ``examples/``, with
``kvspec`` and ``python`` on the PATH as a user's virtual environment has them; each must exit
as marked. The page plants a bug in the example engine (``PUBLISH_WHEN = "scheduled"``), which
the fuzzer must find (exit 1) and ``kvspec check`` must find again in the trace it wrote."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "your-engine.md"
BLOCK = re.compile(r"<!-- run(?:: exit (\d+))? -->\n```sh\n(.*?)```", re.S)


def blocks() -> list[tuple[int, str]]:
    """(expected exit code, script) of each marked block, in page order."""
    return [(int(code or 0), body) for code, body in BLOCK.findall(PAGE.read_text())]


def test_the_page_marks_its_commands() -> None:
    found = blocks()
    assert len(found) >= 6
    assert any("PUBLISH_WHEN" in body for _, body in found)  # the planted bug
    assert "docs/your-engine.md" in (ROOT / "README.md").read_text().split("\n## ", 1)[0]


def test_the_page_runs_as_written(tmp_path: Path) -> None:
    work = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", work, ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, argv in (("kvspec", f'"{sys.executable}" -m kvspec'), ("python", sys.executable)):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\nexec {argv} "$@"\n')
        tool.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    outputs = []
    for expected, script in blocks():
        done = subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        outputs.append(done.stdout)
        assert done.returncode == expected, (script, done.stdout[-3000:], done.stderr[-3000:])
    planted = next(i for i, (_, body) in enumerate(blocks()) if "PUBLISH_WHEN" in body)
    found = outputs[planted + 1]
    assert "counterexample found" in found and "'publish'" in found
    assert "Disagreement" in outputs[planted + 2]  # kvspec check finds it in the trace
    junit = ET.parse(work / "fuzz.xml").getroot()
    assert junit.find("testsuite/testcase/failure") is not None
    assert (work / "tinypaged" / "engine.py").read_text() == (
        ROOT / "examples" / "tinypaged" / "engine.py"
    ).read_text()  # put back as the page says
