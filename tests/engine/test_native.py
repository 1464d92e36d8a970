"""engine.native, the C-kernel build helper: builds are cached per source, flags, compiler and CPU; a
missing compiler or rejected flags fall back cleanly; LLMAAS_NATIVE=0 turns every kernel off. Built
from a tiny C file of the test's own, so nothing here depends on what a real kernel computes."""

from __future__ import annotations

import ctypes
import os
import warnings
from pathlib import Path

import pytest

from engine import native

SOURCE = "int kernel_answer(void) { return 42; }\n"


@pytest.fixture
def source(tmp_path) -> Path:
    path = tmp_path / "src" / "answer.c"
    path.parent.mkdir()
    path.write_text(SOURCE)
    return path


@pytest.fixture
def cache(monkeypatch, tmp_path) -> Path:
    """A fresh kernel cache folder and no library loaded yet in this process."""
    monkeypatch.setenv("LLMAAS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_loaded", {})
    return tmp_path / "cache" / "kernels"


def test_build_is_cached_per_source_and_cpu(monkeypatch, source, cache):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    lib = native.load("answer", source)
    assert lib is not None and lib.kernel_answer() == 42
    built = sorted(os.listdir(cache))
    assert len(built) == 1 and built[0].startswith("answer-") and built[0].endswith(".so")  # no temporaries
    assert cache / built[0] == native.library_path("answer", source, native._compiler())
    mtime = (cache / built[0]).stat().st_mtime_ns
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("answer", source) is not None
    assert (cache / built[0]).stat().st_mtime_ns == mtime  # reused, not rebuilt
    source.write_text(SOURCE + "int kernel_other(void) { return 7; }\n")
    monkeypatch.setattr(native, "_loaded", {})
    assert native.load("answer", source).kernel_other() == 7  # another source: another library
    assert len(os.listdir(cache)) == 2


def test_missing_compiler_warns_once_and_falls_back(monkeypatch, source, cache):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(RuntimeWarning, match="no C compiler"):
        assert native.load("answer", source) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert native.load("answer", source) is None  # remembered: no second warning, no second attempt
    assert not cache.exists() or not os.listdir(cache)


def test_failed_build_falls_back_to_other_flags_quietly(monkeypatch, source, cache):
    """A build whose flags the compiler rejects (as -fopenmp without an OpenMP runtime) gives way to the
    fallback flags without a warning; with no fallback it warns and returns None."""
    if native._compiler() is None:
        pytest.skip("no C compiler")
    bad = native.EXACT_FLAGS + ("-fno-such-option-here",)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lib = native.load("answer", source, flags=bad, fallback_flags=native.EXACT_FLAGS)
    assert lib is not None and lib.kernel_answer() == 42
    assert os.listdir(cache) == [native.library_path("answer", source, native._compiler()).name]
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.warns(RuntimeWarning, match="unavailable"):
        assert native.load("answer", source, flags=bad) is None


def test_build_raises_with_the_compilers_message(source, cache):
    if native._compiler() is None:
        pytest.skip("no C compiler")
    broken = source.with_name("broken.c")
    broken.write_text("int broken(void) { return }\n")
    with pytest.raises(RuntimeError, match="failed"):
        native.build("broken", broken, native._compiler())
    assert not cache.exists() or not os.listdir(cache)  # the temporary is gone
    assert ctypes.CDLL(str(native.build("answer", source, native._compiler()))).kernel_answer() == 42


def test_switched_off_by_environment(monkeypatch, source, cache):
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert not native.enabled() and native.load("answer", source) is None
    assert not cache.exists()
