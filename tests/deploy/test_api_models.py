"""How an OpenAI `messages` list meets a stored conversation (docs/design.md §6), and the error mapping:
pure functions, no server."""

from __future__ import annotations

import pytest

from deploy.api_models import APIError, Message, check_context_id, from_exception, reconcile, split_stateless

STORED = [{"role": "system", "text": "Be terse."}, {"role": "user", "text": "Hi"},
          {"role": "assistant", "text": "Hello."}]


def msgs(*pairs):
    return [Message(role=r, content=c) for r, c in pairs]


def test_new_turn_only_or_whole_conversation():
    assert reconcile(STORED, msgs(("user", "More?"))).prompt == "More?"
    whole = msgs(("system", "Be terse."), ("user", "Hi"), ("assistant", "Hello. "), ("user", "More?"))
    assert reconcile(STORED, whole).prompt == "More?"  # outer whitespace of a reply is not a conflict
    without_system = msgs(("user", "Hi"), ("assistant", "Hello."), ("user", "More?"))
    assert reconcile(STORED, without_system).prompt == "More?"
    assert reconcile([], msgs(("user", "First"))).prompt == "First"


@pytest.mark.parametrize("bad, code", [
    ((("user", "Hi"), ("assistant", "Goodbye."), ("user", "More?")), "conversation_conflict"),
    ((("system", "Be verbose."), ("user", "More?")), "conversation_conflict"),
    ((("user", "Hi"), ("assistant", "Hello."), ("assistant", "Extra"), ("user", "More?")), "conversation_conflict"),
    ((("user", "Hi"), ("assistant", "Hello.")), "conversation_conflict"),
    ((("user", "One"), ("user", "Two")), "invalid_request"),
])
def test_conflicts_and_bad_turns(bad, code):
    with pytest.raises(APIError) as e:
        reconcile(STORED, msgs(*bad))
    assert e.value.code == code and e.value.status in (409, 422)


def test_stateless_split():
    assert split_stateless(msgs(("system", "S"), ("user", "a"), ("assistant", "b"), ("user", "c"))) == \
        ("S", [("user", "a"), ("assistant", "b")], "c")
    for bad in (msgs(("user", "a"), ("assistant", "b")), msgs(("user", "a"), ("system", "S"), ("user", "c"))):
        with pytest.raises(APIError):
            split_stateless(bad)


def test_ids_and_error_mapping():
    assert check_context_id("0123456789abcdef" * 2)
    for bad in ("../x", "0" * 31, "0" * 33, "G" * 32, "0" * 31 + "\x00", None):
        with pytest.raises(APIError) as e:
            check_context_id(bad)
        assert e.value.status == 404

    class Unknown(Exception):
        code = "unknown_context"

    class Budget(Exception):
        code = "capacity"

    assert from_exception(Unknown("x")).status == 404
    err = from_exception(Budget("full"))
    assert err.status == 503 and err.headers()["Retry-After"]
    assert from_exception(TimeoutError()).status == 408
    assert from_exception(RuntimeError("boom")).status == 500


def test_every_error_code_is_answered_somewhere():
    """One code for one fault, and no code that nothing answers with: each code of `STATUS` is named
    in the code outside the table (where an error is raised or mapped)."""
    import re
    from pathlib import Path

    from deploy.api_models import STATUS

    root = Path(__file__).resolve().parents[2]
    text = "\n".join(p.read_text() for pkg in ("actors", "deploy", "engine", "scheduler", "storage")
                     for p in (root / pkg).rglob("*.py") if p.name != "api_models.py")
    table = re.compile(r'^\s+"\w+": \d+,$|^RETRY_AFTER_S = ')  # the tables themselves
    text += "\n".join(line for line in (root / "deploy" / "api_models.py").read_text().splitlines()
                      if not table.match(line))
    unused = [c for c in STATUS if f'"{c}"' not in text]
    assert not unused, f"codes nothing answers with: {unused}"
