"""Package-wide rules: the scheduler imports no Ray, torch, model or storage code, and every module
says what it is in a docstring."""

from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import scheduler

MODULES = sorted(m.name for m in pkgutil.iter_modules(scheduler.__path__, "scheduler."))


def test_imports_stay_pure():
    code = ("import sys\n"
            f"for m in {MODULES!r}: __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('ray', 'torch', 'engine', 'storage', 'actors', 'transformers'))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_every_module_has_a_docstring_saying_what_it_does_not_know():
    assert {"scheduler.compression", "scheduler.eviction", "scheduler.pipeline", "scheduler.memory",
            "scheduler.policies"} <= set(MODULES)
    for name in MODULES:
        doc = importlib.import_module(name).__doc__ or ""
        assert "deliberately knows nothing" in doc, name
