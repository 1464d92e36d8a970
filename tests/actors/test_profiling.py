"""The cost-profile cache of the profiling run: JSON files keyed by machine, model and throttle,
replaced atomically, a damaged or misplaced file read as a miss. No model, no Ray."""

from __future__ import annotations

import os
import socket

from actors.profiling import ProfileCache, ProfileKey, machine_id
from scheduler.pipeline import CostProfile


def test_profile_cache(tmp_path):
    cache = ProfileCache(tmp_path / "profiles")
    key = ProfileKey.local("smollm2-135m:abc123", throttle_bps=50e6)
    assert key.machine == machine_id()
    assert socket.gethostname() in key.machine and str(os.cpu_count()) in key.machine
    assert cache.get(key) is None
    prof = CostProfile.fit([(1, 0.01), (4, 0.02)], [(1e6, 0.02), (2e6, 0.04)])
    path = cache.put(key, prof)
    assert path.parent == tmp_path / "profiles" and cache.get(key) == prof
    other = ProfileKey.local("smollm2-135m:abc123", throttle_bps=0)
    assert other.filename() != key.filename() and cache.get(other) is None
    # a file under the wrong name (copied by hand) is not taken for another key
    cache.path(other).write_text(path.read_text())
    assert cache.get(other) is None
    path.write_text("{not json")
    assert cache.get(key) is None
    cache.put(key, prof)  # replaces the corrupt file
    assert cache.get(key) == prof
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".profile-")]


def test_profile_key_filename_is_safe():
    name = ProfileKey("host/../x", "a b/c\\d", 0.0).filename()
    assert "/" not in name and "\\" not in name and name.endswith(".json")
