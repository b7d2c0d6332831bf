"""vLLM's CPU platform without triton-cpu, for building a ``VllmConfig`` on an x86 CPU.

From 0.34.0, ``CpuPlatform.check_and_update_config`` raises ``RuntimeError: vLLM on x86 CPUs
requires Triton (triton-cpu)`` where 0.33.0 warned; the rest of the method is unchanged, and
triton-cpu is not on the package registry. Every ``VllmConfig`` runs that hook, so neither the
adapter's configs nor vLLM's own tests can be built on such a CPU.

``install()`` gives vLLM the platform object it resolves for ``VLLM_TARGET_DEVICE=cpu``, of a
subclass of its ``CpuPlatform`` (``SchedulerCpuPlatform``) that runs vLLM's own hook with the
Triton requirement waived for the length of that call, as 0.33.0 did: the hook then configures
the CPU exactly as vLLM does. It is sound for what kvspec runs: the scheduler, the KV-cache manager
and the block pool never call Triton (they are Python over block ids; Triton serves the model
runner's kernels, which kvspec never builds). It is installed only where the installed release
needs it (``versions.Release.cpu_needs_triton``), Triton's CPU backend is absent, and vLLM resolved
its ``CpuPlatform`` itself; elsewhere it does nothing. ``docs/adapters.md`` ("vLLM on a CPU
without triton-cpu") says the same for a user.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from . import versions

_lock = threading.Lock()


def _waived(vllm_config: Any, check: Any) -> None:
    import vllm.triton_utils as triton_utils

    with _lock:
        before = triton_utils.HAS_TRITON
        triton_utils.HAS_TRITON = True  # read by the hook's x86 check alone, at call time
        try:
            check(vllm_config)
        finally:
            triton_utils.HAS_TRITON = before


def install() -> bool:
    """Make vLLM's current platform a ``SchedulerCpuPlatform`` where needed; whether it is."""
    if not versions.installed().cpu_needs_triton:
        return False
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.triton_utils import HAS_TRITON

    current = platforms.current_platform
    if isinstance(current, SchedulerCpuPlatform):
        return True
    if HAS_TRITON or type(current) is not CpuPlatform:
        return False
    # The object vLLM resolved, which every module holding it sees: only its class changes.
    current.__class__ = _platform_class(CpuPlatform)
    return True


_made: dict[type, type] = {}


class SchedulerCpuPlatform:
    """Marker base of the platform ``install`` makes (vLLM's ``CpuPlatform`` subclassed)."""


def _platform_class(base: type) -> type:
    if base not in _made:
        check = base.check_and_update_config

        def check_and_update_config(cls: type, vllm_config: Any) -> None:
            _waived(vllm_config, check)

        _made[base] = type(
            "SchedulerCpuPlatform",
            (base, SchedulerCpuPlatform),
            {
                "check_and_update_config": classmethod(check_and_update_config),
                "__doc__": "vLLM's CpuPlatform, its Triton requirement waived (cpu_platform.py).",
                "__module__": __name__,
            },
        )
    return _made[base]


def pytest_configure(config: Any) -> None:
    """As a pytest plugin (``-p kvspec.conformance.adapters.vllm_adapter.cpu_platform``):
    install before vLLM's tests build a config (``thirdparty/vllm_suite.py`` loads it in
    both of its passes, so it changes no outcome between them)."""
    install()
