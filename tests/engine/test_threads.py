"""Helper threads run torch on one thread, without changing the main thread's count, whatever the
process's default becomes meanwhile (engine/threads.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine.threads import single_threaded_torch, torch_threads


def test_helper_thread_runs_torch_alone_and_the_main_thread_keeps_its_count():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ThreadPoolExecutor(1, initializer=single_threaded_torch) as pool:
            inside = pool.submit(torch.get_num_threads).result()
            pool.submit(lambda: torch.ones(1 << 20).to(torch.float16)).result()  # a parallel-sized op
        assert inside == 1
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_thread_keeps_its_count_when_another_changes_the_default_before_its_first_op():
    """A thread's first op takes the process's default count; `torch_threads` applies it at once, so a
    count set in another thread in between does not replace this thread's (the executor's background
    group would otherwise run a second team beside the calls' thread)."""
    import threading

    before = torch.get_num_threads()
    set_here, default_changed = threading.Event(), threading.Event()
    seen: list[int] = []

    def helper():
        torch_threads(1)
        set_here.set()
        default_changed.wait(60)
        torch.ones(1 << 20).to(torch.float16)  # its first parallel-sized op
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=helper)
    t.start()
    try:
        assert set_here.wait(60)
        torch_threads(2)  # the calls' thread sets its count, and so the process's default
        default_changed.set()
        t.join(60)
        assert seen == [1]
        assert torch.get_num_threads() == 2
    finally:
        default_changed.set()
        torch.set_num_threads(before)
