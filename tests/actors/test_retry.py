"""The one retry rule (actors/retry.py) without Ray processes: a call refused while its actor restarts
is sent again until it answers, and past the wait it fails with `ActorRestartingError`; the wait comes
from `LLMAAS_RESTART_WAIT_S` where it is set."""

from __future__ import annotations

import asyncio

import pytest
import ray

from actors import retry
from actors.config import RESTART_WAIT_S


class Restarting:
    """A method handle whose first `refusals` calls find the actor restarting."""

    def __init__(self, refusals: int) -> None:
        self.refusals, self.sent = refusals, 0

    def remote(self, x):
        self.sent += 1

        async def reply():
            if self.sent <= self.refusals:
                raise ray.exceptions.ActorUnavailableError("the actor is restarting", None)
            return x * 2

        return reply()


def test_a_call_is_sent_again_until_the_restarted_actor_answers():
    method = Restarting(refusals=3)
    assert asyncio.run(retry.acall(method, 21)) == 42
    assert method.sent == 4


def test_past_the_wait_the_caller_gets_unavailable():
    method = Restarting(refusals=10)
    with pytest.raises(retry.ActorRestartingError) as err:
        asyncio.run(retry.acall(method, 1, deadline_s=-1.0))  # already past: no second try
    assert err.value.code == "unavailable" and method.sent == 1


def test_the_wait_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("LLMAAS_RESTART_WAIT_S", raising=False)
    assert retry.restart_wait_s() == RESTART_WAIT_S
    monkeypatch.setenv("LLMAAS_RESTART_WAIT_S", "600")
    assert retry.restart_wait_s() == 600.0
    for bad in ("soon", "0", "-5"):
        monkeypatch.setenv("LLMAAS_RESTART_WAIT_S", bad)
        with pytest.raises(ValueError, match="LLMAAS_RESTART_WAIT_S"):
            retry.restart_wait_s()
