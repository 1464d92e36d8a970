"""The typed ports: every in-process class and every Ray stub offers each method of its role's
`Protocol` with the same parameters, nothing in the actor layer dispatches calls by name, and the
KV key keeps K/V made under one model format away from another. No Ray cluster, no model."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import numpy as np
import pytest

from actors import ports
from actors.executor import ModelExecutor
from actors.governor import MemoryGovernor
from actors.messages import KVKey
from actors.ray_stubs import ExecutorStub, GovernorStub, RecomputeStub, SwapIOStub
from actors.recompute import RecomputeWorker
from actors.swapio import KVSwapIO

ROOT = Path(__file__).resolve().parents[2]

IMPLEMENTATIONS = [
    (ports.GovernorPort, MemoryGovernor), (ports.GovernorPort, GovernorStub),
    (ports.SwapIOPort, KVSwapIO), (ports.SwapIOPort, SwapIOStub),
    (ports.RecomputePort, RecomputeWorker), (ports.RecomputePort, RecomputeStub),
    (ports.ExecutorPort, ModelExecutor), (ports.ExecutorPort, ExecutorStub),
]


def _protocol_methods(proto) -> list[str]:
    return sorted(n for n in vars(proto) if not n.startswith("_") and callable(getattr(proto, n)))


@pytest.mark.parametrize("proto,impl", IMPLEMENTATIONS, ids=lambda x: x.__name__)
def test_each_transport_implements_every_method_of_its_port(proto, impl):
    methods = _protocol_methods(proto)
    assert methods
    for name in methods:
        assert callable(getattr(impl, name, None)), f"{impl.__name__} lacks {proto.__name__}.{name}"
        want = [p for p in inspect.signature(getattr(proto, name)).parameters][1:]
        got = [p for p in inspect.signature(getattr(impl, name)).parameters][1:]
        assert got[:len(want)] == want, f"{impl.__name__}.{name}{got} against {proto.__name__}.{name}{want}"


def test_the_governor_actor_offers_the_port_by_name():
    from actors.ray_actors import GovernorActor

    for name in _protocol_methods(ports.GovernorPort):
        if name == "begin_cached_call":  # the stub sends `begin_call(cached=True)` without waiting
            continue
        assert callable(getattr(GovernorActor, name, None)), name


def test_no_call_is_dispatched_by_name():
    """No `__getattr__` proxy and no `getattr(obj, method)(...)` call in the service's packages."""
    offenders = []
    for pkg in ("actors", "deploy"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} __getattr__")
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Call)
                        and isinstance(node.func.func, ast.Name) and node.func.func.id == "getattr"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} getattr(...)(...)")
    assert offenders == []


def test_ports_and_messages_import_no_ray_and_no_actor_module():
    for mod in ("actors/ports.py", "actors/messages.py"):
        tree = ast.parse((ROOT / mod).read_text())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert "ray" not in names, mod
        assert not {n for n in names if n.startswith("actors.") and n != "actors.messages"}, mod


def test_the_kv_key_tags_records_by_model_format_and_adapter():
    base = KVKey("f" * 16)
    assert base.record_tag() == "f" * 16  # records written before formats existed stay readable
    tags = {base.record_tag(), KVKey("f" * 16, "int4").record_tag(), KVKey("f" * 16, adapter="a").record_tag(),
            KVKey("f" * 16, "int4", "a").record_tag(), KVKey("e" * 16).record_tag()}
    assert len(tags) == 5
    assert KVKey("f" * 16, "int8", "a", app="x").model_part() == KVKey("f" * 16, "int8", "a")
    assert KVKey("f" * 16, app="x").record_tag() == base.record_tag()  # apps share the store, not contexts


def test_chunks_written_under_one_key_are_not_read_under_another(tmp_path):
    from storage import codecs

    kv = np.random.default_rng(0).standard_normal((2, 2, 1, 16, 8)).astype(np.float32)
    enc = codecs.encode(kv, "raw", dtype="float32")
    KVSwapIO(str(tmp_path), KVKey("m").record_tag()).write("c" * 32, [(0, enc, 0)])
    got, failed = KVSwapIO(str(tmp_path), KVKey("m").record_tag()).read("c" * 32, [0])
    assert np.array_equal(codecs.decode(got[0]), kv) and not failed
    got, failed = KVSwapIO(str(tmp_path), KVKey("m", "int4").record_tag()).read("c" * 32, [0])
    assert got == {} and failed == {0: "chunk_fingerprint"}


def test_chunk_records_carry_the_adapter_they_were_computed_under(tmp_path):
    """A context's records name its LoRA adapter: every way of reading them under another adapter
    (or none) fails the chunk, so it is recomputed."""
    from storage import codecs

    kv = np.random.default_rng(0).standard_normal((2, 2, 1, 16, 8)).astype(np.float32)
    enc = codecs.encode(kv, "raw", dtype="float32")
    io = KVSwapIO(str(tmp_path / "chunks"), KVKey("m", "int4"))
    io.write("c" * 32, [(0, enc, 0), (1, enc, 16)], adapter="a@1")
    assert io.store.check("c" * 32, 0, tag=KVKey("m", "int4", "a@1").record_tag()).nbytes > 0
    got, failed = io.read("c" * 32, [0, 1], adapter="a@1")
    assert np.array_equal(codecs.decode(got[1]), kv) and not failed
    for adapter in ("", "a@2", "b@1"):
        got, failed = io.read("c" * 32, [0, 1], adapter)
        assert got == {} and failed == {0: "chunk_fingerprint", 1: "chunk_fingerprint"}
        (batch,) = io.read_batches("c" * 32, [0, 1], 2, adapter)
        assert batch.chunks == [] and batch.failed == failed
        (group,) = io.read_groups("c" * 32, [0, 1], [range(2)], adapter)
        assert group.chunks == {} and group.failed == failed
    (group,) = io.read_groups("c" * 32, [0, 1], [range(2)], "a@1")
    assert sorted(group.chunks) == [0, 1] and not group.failed


def test_port_methods_have_docstrings():
    for proto in (ports.GovernorPort, ports.SwapIOPort, ports.RecomputePort, ports.ExecutorPort):
        for name in _protocol_methods(proto):
            assert (getattr(proto, name).__doc__ or "").strip(), f"{proto.__name__}.{name}"
    assert typing.get_type_hints(ports.GovernorPort.commit_call)["return"].__name__ == "CommitReply"
