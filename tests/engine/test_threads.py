"""Helper threads run torch on one thread, without changing the main thread's count (engine/threads.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from engine.threads import single_threaded_torch


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
