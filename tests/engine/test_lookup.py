"""Lookup decoding (engine/lookup.py, `EngineConfig.lookup_draft`): the guesses, and replies and context
state equal to one-token-a-pass decoding."""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.context import ContextEngine
from engine.lookup import draft

SYSTEM = "You repeat what you are given."
PROMPT = ("Copy this list exactly, one item per line: red apple, green pear, yellow lemon, purple plum, "
          "orange tangerine, red apple, green pear, yellow lemon.")


def test_draft_takes_the_longest_latest_suffix():
    # suffix (7, 8) occurs twice before: the latest occurrence is followed by 9, 1
    assert draft([7, 8, 5, 5, 7, 8, 9, 1, 2, 7, 8], 2) == [9, 1]
    # the 3-token suffix (1, 7, 8) beats the later 2-token match
    assert draft([1, 7, 8, 4, 4, 7, 8, 6, 1, 7, 8], 3) == [4, 4, 7]
    # the guess runs to the sequence's end, and is cut at n_tokens
    assert draft([3, 4, 5, 3, 4], 8) == [5, 3, 4]
    assert draft([3, 4, 5, 6, 3, 4], 1) == [5]
    # the suffix's own occurrence is no guess; single tokens are not looked up
    assert draft([1, 2, 3], 4) == []
    assert draft([5, 9, 5], 4) == []
    assert draft([1, 2, 3], 0) == []


@pytest.fixture(scope="module")
def lookup_engine(engine):
    """The session's model under a second engine whose decode guesses up to 8 tokens a pass."""
    return ContextEngine(engine.model, engine.tok, EngineConfig(lookup_draft=8))


def state(ctx):
    return list(ctx.token_ids), ctx.cache.length, ctx.prefilled_tokens, len(ctx.density)


def test_lookup_replies_equal_one_token_a_pass(engine, lookup_engine):
    plain, fast = engine.new_ctx(SYSTEM), lookup_engine.new_ctx(SYSTEM)
    before = (lookup_engine.lookup.passes, lookup_engine.lookup.kept)
    for prompt in (PROMPT, "Now copy it once more."):
        a = engine.call(plain, prompt, max_tokens=48)
        b = lookup_engine.call(fast, prompt, max_tokens=48)
        assert b.token_ids == a.token_ids and b.text == a.text
        assert (b.prefilled_tokens, b.cached_tokens, b.finish_reason) == (a.prefilled_tokens, a.cached_tokens,
                                                                          a.finish_reason)
        # as a plain decode leaves it: the reply's last token (and the turn's closing) not computed yet
        assert state(fast) == state(plain)
    passes, kept = lookup_engine.lookup.passes - before[0], lookup_engine.lookup.kept - before[1]
    assert passes > 0 and kept > 10, (passes, kept)  # the list was guessed, not decoded token by token
    n = fast.cache.length
    assert torch.allclose(fast.cache.kv[:, :, :, :n], plain.cache.kv[:, :, :, :n], atol=1e-4, rtol=1e-4)


def test_lookup_stop_inside_kept_tokens(engine, lookup_engine):
    """A stop string reached inside the tokens one pass kept ends the reply there, the context as after a
    plain decode."""
    plain, fast = engine.new_ctx(SYSTEM), lookup_engine.new_ctx(SYSTEM)
    a = engine.call(plain, PROMPT, max_tokens=48, stop=["lemon"])
    b = lookup_engine.call(fast, PROMPT, max_tokens=48, stop=["lemon"])
    assert a.finish_reason == "stop" and b.text == a.text and b.token_ids == a.token_ids
    assert state(fast) == state(plain)
    a = engine.call(plain, "Again.", max_tokens=16)
    b = lookup_engine.call(fast, "Again.", max_tokens=16)
    assert b.token_ids == a.token_ids and state(fast) == state(plain)


def test_lookup_under_repetition_penalties(engine, lookup_engine):
    """Penalties count each guessed token before the next guess is checked, and a pass's kept tokens
    once: the replies equal one-token-a-pass decoding under the same penalties."""
    penalties = {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1}
    plain, fast = engine.new_ctx(SYSTEM), lookup_engine.new_ctx(SYSTEM)
    a = engine.call(plain, PROMPT, max_tokens=40, **penalties)
    unpenalized = engine.call(engine.new_ctx(SYSTEM), PROMPT, max_tokens=40)
    kept = lookup_engine.lookup.kept
    b = lookup_engine.call(fast, PROMPT, max_tokens=40, **penalties)
    assert a.token_ids != unpenalized.token_ids  # the penalties matter here
    assert b.token_ids == a.token_ids and state(fast) == state(plain)
    assert lookup_engine.lookup.kept > kept  # and guesses were kept under them


def test_lookup_only_when_greedy(lookup_engine):
    ctx = lookup_engine.new_ctx(SYSTEM)
    passes = lookup_engine.lookup.passes
    lookup_engine.call(ctx, PROMPT, max_tokens=24, temperature=0.8, seed=3)
    assert lookup_engine.lookup.passes == passes


def test_lookup_draft_is_checked():
    with pytest.raises(ValueError, match="lookup_draft"):
        EngineConfig(lookup_draft=-1)
