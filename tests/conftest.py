"""Shared pytest setup: Hypothesis profiles.

Pick one with the HYPOTHESIS_PROFILE environment variable (default: ``dev``):

* ``dev``  -- Hypothesis defaults, no deadline (first calls into torch/z3 are slow).
* ``ci``   -- modest and reproducible: fixed seed, failing examples printed as blobs.
* ``fuzz`` -- long runs to hunt for bugs (100k examples per test).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile("dev", deadline=None)
settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("fuzz", max_examples=100_000, deadline=None)

settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))
