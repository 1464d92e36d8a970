"""`llmaas chat --url` and `llmaas contexts` against the session's server, as a user runs them (a
subprocess that imports no torch), with their errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from deploy.client import Client


def llmaas(*args, stdin: str = "", token: str | None = None, timeout: float = 600):
    """The CLI in a subprocess. `timeout` only guards against a hang: above the client's own request
    timeout (300 s), since under load a first `rag add` (the embedding model loads) took over 120 s."""
    env = dict(os.environ)
    env.pop("LLMAAS_TOKEN", None)
    if token:
        env["LLMAAS_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def app(server):
    return Client(server.url, Client(server.url, server.admin).bind("cli-tests"))


def test_contexts_list_show_delete(server, app):
    ctx = app.new_ctx("You are terse.")
    app.call(ctx, "Name a colour.", max_tokens=4)
    r = llmaas("contexts", "list", "--url", server.url, token=app.token)
    assert r.returncode == 0 and ctx in r.stdout, r.stderr
    r = llmaas("contexts", "show", ctx, "--url", server.url, "--token", app.token)
    assert r.returncode == 0 and "[user] Name a colour." in r.stdout and "[assistant]" in r.stdout
    r = llmaas("contexts", "delete", ctx, "--url", server.url, token=app.token)
    assert r.returncode == 0
    r = llmaas("contexts", "show", ctx, "--url", server.url, token=app.token)
    assert r.returncode == 1 and "not_found" in r.stderr and "Traceback" not in r.stderr


def test_chat_url_continues_a_context(server, app):
    ctx = app.new_ctx()
    r = llmaas("chat", "--url", server.url, "--context", ctx, "--max-tokens", "6", stdin="Say hello.\n/exit\nignored\n",
               token=app.token)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    turns = app.context(ctx)["turns"]
    assert [t["role"] for t in turns] == ["user", "assistant"] and turns[1]["text"].strip() == r.stdout.strip()


def test_clear_errors(server, app):
    r = llmaas("contexts", "list", "--url", server.url, token="wrong")
    assert r.returncode == 1 and "unauthorized" in r.stderr and "Traceback" not in r.stderr
    r = llmaas("contexts", "list", "--url", server.url)
    assert r.returncode != 0 and "token" in r.stderr
    r = llmaas("contexts", "list", "--url", "http://127.0.0.1:9", token=app.token)
    assert r.returncode == 1 and "cannot reach" in r.stderr
    r = llmaas("contexts", "show", "--url", server.url, token=app.token)
    assert r.returncode != 0 and "needs a context id" in r.stderr
    r = llmaas("chat", "--url", server.url, "--temperature", "-1", stdin="hi\n", token=app.token)
    assert "invalid_request" in r.stderr and "Traceback" not in r.stderr


def test_serve_rejects_bad_options_before_starting_anything(tmp_path):
    r = llmaas("serve", "--policy", "nope", "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "unknown policy 'nope'" in r.stderr and "llms" in r.stderr
    r = llmaas("serve", "--kv-budget", "0", "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "--kv-budget" in r.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: llms\npool_byts: 5\n")
    r = llmaas("serve", "--config", str(cfg), "--data-dir", str(tmp_path / "d"))
    assert r.returncode == 2 and "pool_byts" in r.stderr and "pool_bytes" in r.stderr
    assert not (tmp_path / "d").exists()  # nothing was created, no Ray was started
    r = llmaas("serve", "--help")
    assert r.returncode == 0 and "--kv-budget" in r.stdout and "127.0.0.1" in r.stdout


def test_adapters_add_list_delete(server, app, engine):
    from bench.model_files import random_adapter

    random_adapter(server.data_dir / "adapters" / "cli-lora", engine.model.cfg, seed=5, rank=4)
    r = llmaas("adapters", "add", "cli-lora", "cli-lora", "--url", server.url, token=app.token)
    assert r.returncode == 1 and "unauthorized" in r.stderr  # an app's token does not load adapters
    r = llmaas("adapters", "add", "cli-lora", "cli-lora", "--url", server.url, token=server.admin)
    assert r.returncode == 0 and "loaded cli-lora" in r.stderr, r.stderr
    r = llmaas("adapters", "list", "--url", server.url, token=app.token)
    assert r.returncode == 0 and r.stdout.startswith("cli-lora  rank 4"), r.stdout
    r = llmaas("adapters", "delete", "cli-lora", "--url", server.url, token=server.admin)
    assert r.returncode == 0
    r = llmaas("adapters", "delete", "cli-lora", "--url", server.url, token=server.admin)
    assert r.returncode == 1 and "unknown_adapter" in r.stderr and "Traceback" not in r.stderr


def test_rag_add_a_folder_then_ask(server, app, tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "fuji.txt").write_text("Mount Fuji is 3,776 metres tall and last erupted in 1707.")
    (tmp_path / "notes" / "nile.md").write_text("# Nile\n\nThe Nile flows north into the Mediterranean Sea.")
    (tmp_path / "notes" / "skip.bin").write_bytes(b"\0\1")
    r = llmaas("rag", "add", str(tmp_path / "notes"), "-c", "notes", "--url", server.url, token=app.token)
    assert r.returncode == 0 and "2 documents" in r.stderr, r.stderr
    r = llmaas("rag", "ask", "How", "tall", "is", "Mount", "Fuji?", "-c", "notes", "--max-tokens", "8",
               "--url", server.url, token=app.token)
    assert r.returncode == 0 and r.stdout.strip() and "miss" in r.stderr, r.stderr
    r = llmaas("rag", "collections", "--url", server.url, token=app.token)
    assert r.returncode == 0 and "notes  2 documents" in r.stdout
    r = llmaas("rag", "ask", "anything", "-c", "missing", "--url", server.url, token=app.token)
    assert r.returncode == 1 and "collection_not_found" in r.stderr and "Traceback" not in r.stderr
