"""Suite-wide settings: a hypothesis profile sized for 2-core CI machines."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

# Timing varies too much on shared 2-core machines for per-example deadlines to mean
# anything; correctness properties are what the examples check.
settings.register_profile(
    "ci",
    deadline=None,
    max_examples=100,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("thorough", deadline=None, max_examples=2000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
