"""The vLLM environments kvspec's tests run the adapter in: one per supported release
(``make thirdparty``: ``.venv-vllm`` holds 0.33.0, ``.venv-vllm-VERSION`` the others;
``conformance/adapters/vllm_adapter/versions.py`` lists them). ``VENVS`` parametrizes a test over
them, each skipped with the reason where it is not built."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RELEASES = {"0.33.0": ".venv-vllm", "0.34.0": ".venv-vllm-0.34.0"}


def _param(version: str, folder: str) -> object:
    built = (ROOT / folder / ".stamp").exists()
    why = f"no {folder} (vLLM {version}): run `make thirdparty` to build it"
    return pytest.param(
        ROOT / folder, id=f"vllm-{version}", marks=pytest.mark.skipif(not built, reason=why)
    )


VENVS = [_param(version, folder) for version, folder in RELEASES.items()]
