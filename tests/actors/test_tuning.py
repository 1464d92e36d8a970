"""The speed-only optimisations' switches (`actors.config.Tuning`): how they are given (Python, a
config file's mapping, `serve run ... tuning.NAME=VALUE`), refused when unknown or malformed, and
what a switch turned off changes, without a model or Ray."""

from __future__ import annotations

import json

import pytest
import torch

from actors.config import OPENMP_SPIN, ServiceConfig, Tuning, tuning_from


def test_tuning_defaults_to_everything_on():
    t = ServiceConfig().tuning
    assert t == Tuning()
    assert t.streaming_stores
    assert t.object_chunks == 16
    assert t.lookup_draft == 4
    assert t.executor_spin == OPENMP_SPIN == 10000  # short: a busy box's calls several times faster


def test_tuning_from_a_mapping_takes_booleans_numbers_and_their_strings():
    t = tuning_from({"streaming_stores": "0", "object_chunks": "4"})
    assert t == Tuning(streaming_stores=False, object_chunks=4)
    assert ServiceConfig(tuning={"streaming_stores": "off"}).tuning == Tuning(streaming_stores=False)


@pytest.mark.parametrize("options, message", [
    ({"streaming_store": False}, "unknown tuning options ['streaming_store']"),
    ({"streaming_stores": "maybe"}, "streaming_stores takes true or false"),
    ({"object_chunks": 0}, "object_chunks must be >= 1"),
    ({"lookup_draft": -1}, "lookup_draft must be >= 0"),
])
def test_bad_tuning_options_are_refused_with_their_name(options, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        tuning_from(options)


def test_serve_options_take_tuning_keys_and_a_config_files_mapping(tmp_path):
    from deploy.serve_app import app_options
    from deploy.server import load_config_file

    service, _server = app_options({"data_dir": str(tmp_path), "tuning.streaming_stores": "false",
                                    "tuning.object_chunks": "2"})
    assert ServiceConfig(**service).tuning == Tuning(streaming_stores=False, object_chunks=2)
    path = tmp_path / "options.json"
    path.write_text(json.dumps({"tuning": {"streaming_stores": False}}))
    opts = load_config_file(str(path))
    assert ServiceConfig(**opts).tuning == Tuning(streaming_stores=False)
    service, _server = app_options({"data_dir": str(tmp_path), **opts})
    assert ServiceConfig(**service).tuning == Tuning(streaming_stores=False)
    with pytest.raises(ValueError, match="unknown tuning options"):
        app_options({"data_dir": str(tmp_path), "tuning.nope": "1"})
    with pytest.raises(ValueError, match="tuning takes a mapping"):
        app_options({"data_dir": str(tmp_path), "tuning": "fast"})
    # the RAG cache's options the same two ways
    service, _server = app_options({"data_dir": str(tmp_path), "rag.predict": "false", "rag.idle_after_s": "30",
                                    "rag": {"k": 3}})
    assert (ServiceConfig(**service).rag.predict, ServiceConfig(**service).rag.idle_after_s,
            ServiceConfig(**service).rag.k) == (False, 30.0, 3)
    with pytest.raises(ValueError, match="unknown rag options"):
        app_options({"data_dir": str(tmp_path), "rag.nope": "1"})


def test_streaming_stores_switch_turns_non_temporal_stores_off():
    from types import SimpleNamespace

    from actors.restore import STREAM_MIN_BYTES, use_streaming_stores

    per_token = 1 << 16
    ws = SimpleNamespace(nbytes=lambda: 4096 * per_token, chunk_nbytes=lambda: 16 * per_token, capacity=4096,
                         chunk_tokens=16, device=torch.device("cpu"), kv=torch.zeros(1))
    n = -(-STREAM_MIN_BYTES // (16 * per_token))
    assert use_streaming_stores(ws, n) and not use_streaming_stores(ws, n - 1)
    assert not use_streaming_stores(ws, n, enabled=False)


def test_lookup_draft_reaches_the_executors_engine():
    from actors.service import components
    from engine.config import ModelConfig, RopeConfig

    shape = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                        n_heads=2, n_kv_heads=1, head_dim=16, rms_norm_eps=1e-5, rope=RopeConfig(10000.0),
                        max_positions=64, tie_embeddings=True)
    assert ServiceConfig().tuning.lookup_draft == 4
    config = ServiceConfig(tuning={"lookup_draft": "6"})
    assert components(config, shape, "float32").engine.lookup_draft == 6


def test_the_executors_openmp_spin_is_set_unless_off_or_the_users_environment_says_how_threads_wait(
        monkeypatch):
    from actors.config import openmp_env
    from actors.ray_service import executor_env

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    assert executor_env(Tuning()) == {"env_vars": {"GOMP_SPINCOUNT": "10000"}}
    assert openmp_env(250) == {"GOMP_SPINCOUNT": "250"}
    assert openmp_env(0) == {} and executor_env(Tuning(executor_spin=0)) is None  # libgomp's default
    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        with monkeypatch.context() as m:
            m.setenv(name, "PASSIVE" if name == "OMP_WAIT_POLICY" else "1")
            assert openmp_env(10000) == {} and executor_env(Tuning(executor_spin=10000)) is None
    with pytest.raises(ValueError, match="executor_spin must be >= 0"):
        Tuning(executor_spin=-1)
