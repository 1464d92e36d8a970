"""storage.heap: freed MB-sized buffers are kept for reuse, so touching them again costs no page faults.
Each case runs in a fresh process (importing numpy only): malloc settings are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from storage.heap import retain_freed_memory

PROBE = r"""
import resource, sys
import numpy as np
from storage.heap import retain_freed_memory
print(retain_freed_memory() if sys.argv[1] == "on" else False)
def faults_of_one_round():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [np.empty(6 << 20, np.uint8) for _ in range(12)]  # 72 MiB in 6 MiB buffers (like a context's
    for a in bufs:                                            # chunk payloads), written once, all freed
        a.fill(1)
    del bufs, a
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_one_round()  # the first round faults either way
print(faults_of_one_round())
"""


def run(mode: str, **env) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env}, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    took, faults = out.stdout.split()
    return took == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_buffers_are_reused_without_page_faults():
    on, faults_on = run("on")
    _, faults_off = run("off")
    assert on
    assert faults_off >= 12 * (6 << 20) // 4096 // 4  # glibc gave much of it back: faulted in again
    assert faults_on < faults_off / 20


def test_env_turns_it_off_and_bad_values_are_refused(monkeypatch):
    monkeypatch.setenv("LLMAAS_HEAP_RETAIN_MIB", "0")
    assert retain_freed_memory() is False
    monkeypatch.setenv("LLMAAS_HEAP_RETAIN_MIB", "lots")
    with pytest.raises(ValueError, match="LLMAAS_HEAP_RETAIN_MIB"):
        retain_freed_memory()
