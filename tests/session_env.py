"""The environment a new terminal would have, taken when tests/conftest.py imports this module
(before any test module is imported): what tests and the libraries they import later write into
os.environ (scikit-learn's KMP_* switches, DeepSpeed's RANK and WORLD_SIZE, a benchmark's
allocator setting) does not reach a test that runs commands as a user would (tests/test_readme.py)."""
from __future__ import annotations

import os

START = dict(os.environ)


def changed_since_start() -> list[str]:
    """The names of the variables added, removed or changed since the session started."""
    return sorted(k for k in {*os.environ, *START} if os.environ.get(k) != START.get(k))
