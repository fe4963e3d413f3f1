"""The fast loop's lists (``conftest.py``) name modules and tests that exist: a renamed test
left in ``SLOW_TESTS`` would silently come back into ``pytest -m "not slow"``."""

from __future__ import annotations

import re
from pathlib import Path

from .conftest import SLOW_MODULES, SLOW_TESTS

TESTS = Path(__file__).parent


def test_every_slow_module_exists():
    missing = sorted(m for m in SLOW_MODULES if not (TESTS / f"{m}.py").is_file())
    assert not missing, missing


def test_every_slow_test_is_a_test_of_its_module():
    missing = []
    for name in sorted(SLOW_TESTS):
        module, fn = name.split("::")
        path = TESTS / f"{module}.py"
        if not path.is_file() or not re.search(rf"^(async )?def {re.escape(fn)}\(", path.read_text(), re.M):
            missing.append(name)
    assert not missing, missing
    assert not {n.split("::")[0] for n in SLOW_TESTS} & SLOW_MODULES  # a whole slow module needs no names
