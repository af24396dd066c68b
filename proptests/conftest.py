"""Hypothesis profiles. "ci" (the default) runs ~200 examples per state machine; pick another with
HYPOTHESIS_PROFILE=dev (quick) or =thorough (long soak)."""

import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=200, stateful_step_count=50, **_common)
settings.register_profile("dev", max_examples=30, stateful_step_count=30, **_common)
settings.register_profile("thorough", max_examples=2000, stateful_step_count=80, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
