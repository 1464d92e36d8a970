"""The benchmark harness's own hygiene: `bench.switching.freeze_startup_objects`, which keeps a full
garbage collection of the harness process out of the timed calls."""

from __future__ import annotations

import os
import subprocess
import sys

FREEZE_PROBE = r"""
import gc, weakref
from bench.switching import freeze_startup_objects

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)

kept = [[Node() for _ in range(10)] for _ in range(2000)]  # start-up objects that stay alive
gone = cycle()                                              # and start-up garbage in a cycle
n = freeze_startup_objects()
later = cycle()
collected_later = gc.collect()
print(gone() is None, n >= 22000, n == gc.get_freeze_count(), later() is None and collected_later >= 2)
"""


def test_freeze_startup_objects_collects_once_then_freezes_what_is_alive():
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    # the cycle made before was collected, not frozen; the live objects were frozen; a cycle made
    # after is collected as usual
    assert out.stdout.split() == ["True", "True", "True", "True"], out.stdout + out.stderr
