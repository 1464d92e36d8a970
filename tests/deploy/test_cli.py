"""The `llmaas` command line: its plain commands run as a user runs them (a subprocess); the variants of
their flags run in this process through the same entry point (`deploy.cli.main`), which spares each the
seconds a new process takes to import torch and load the model."""

from __future__ import annotations

import os
import subprocess
import sys

PROMPT = "What is the capital of Italy?"


def run(*args, stdin=None, timeout=600):
    """The CLI in a subprocess; `timeout` only guards against a hang (no test here bets on a duration)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def run_here(capsys, *args) -> tuple[int, str, str]:
    """`llmaas ARGS` in this process: (exit status, stdout, stderr) as `run` gives them."""
    from deploy.cli import main

    capsys.readouterr()
    try:
        code = main(list(args))
    except SystemExit as e:  # argparse's errors, and messages the commands exit with
        code = e.code
    out, err = capsys.readouterr()
    if isinstance(code, str):  # what the interpreter does with `SystemExit("message")`
        code, err = 1, err + code + "\n"
    return code, out, err


def test_help_lists_commands():
    r = run("--help")
    assert r.returncode == 0
    assert "generate" in r.stdout and "chat" in r.stdout
    r = run("generate", "--help")
    assert "--max-tokens" in r.stdout and "--top-p" in r.stdout and "--model" in r.stdout


def test_generate_prints_only_the_greedy_reply(engine):
    expected = engine.call(engine.new_ctx(), PROMPT, max_tokens=12).text
    r = run("generate", "--chat", "--prompt", PROMPT, "--max-tokens", "12")
    assert r.returncode == 0, r.stderr
    assert r.stdout == expected + "\n"


def test_chat_repl_keeps_one_context(engine):
    ctx = engine.new_ctx()
    first = engine.call(ctx, "My name is Ann.", max_tokens=10).text
    second = engine.call(ctx, "What is my name?", max_tokens=10).text
    r = run("chat", "--max-tokens", "10", stdin="My name is Ann.\nWhat is my name?\n/stats\n")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [first, second]
    assert "tokens" in r.stderr  # /stats goes to stderr


def test_bad_arguments_fail_clearly(capsys):
    code, out, err = run_here(capsys, "generate", "--prompt", "x", "--top-p", "3")
    assert code == 2 and "top_p" in err and out == ""
    code, out, err = run_here(capsys, "generate", "--prompt", "x", "--model", "/nonexistent/model.gguf")
    assert code == 2 and "does not exist" in err


def test_generate_under_a_lora_adapter(engine, tmp_path, capsys):
    """`--adapter DIR`: the reply is the engine's under the same adapter (and not the base model's);
    a directory that is no adapter fails with the adapter's error code, no traceback."""
    from bench.model_files import random_adapter
    from engine.lora import AdapterSet

    random_adapter(tmp_path / "tutor", engine.model.cfg, seed=1)
    adapter = AdapterSet(tmp_path, engine.model.cfg).add("tutor", "tutor")
    expected = engine.call(engine.new_ctx(adapter=adapter), PROMPT, max_tokens=8).text
    assert expected != engine.call(engine.new_ctx(), PROMPT, max_tokens=8).text
    code, out, err = run_here(capsys, "generate", "--chat", "--prompt", PROMPT, "--max-tokens", "8", "--adapter",
                              str(tmp_path / "tutor"))
    assert code == 0, err
    assert out == expected + "\n"
    code, out, err = run_here(capsys, "generate", "--prompt", PROMPT, "--adapter", str(tmp_path / "nowhere"))
    assert code == 2 and "no adapter at" in err


def test_generate_and_serve_take_a_kv_format(engine, capsys):
    """`--kv-format kv8`: the reply is the engine's on a kv8 working set; `serve` refuses kv8 under a
    lossless policy before starting anything."""
    import pytest

    from deploy.cli import build_parser
    from deploy.server import options_from_args
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    kv8 = ContextEngine(engine.model, engine.tok, EngineConfig(kv_format="kv8"))
    expected = kv8.call(kv8.new_ctx(), PROMPT, max_tokens=12).text
    code, out, err = run_here(capsys, "generate", "--chat", "--prompt", PROMPT, "--max-tokens", "12", "--kv-format",
                              "kv8")
    assert code == 0, err
    assert out == expected + "\n"
    args = build_parser().parse_args(["serve", "--kv-format", "kv8", "--data-dir", "/tmp/unused"])
    assert options_from_args(args)["kv_format"] == "kv8"
    args = build_parser().parse_args(["serve", "--kv-format", "kv8", "--policy", "swap", "--data-dir", "/tmp/x"])
    with pytest.raises(ValueError, match="lossless"):
        options_from_args(args)


def test_write_stream_puts_progress_on_stderr_and_text_on_stdout():
    import io

    from deploy.cli import write_stream
    from engine.context import PrefillProgress

    out, err = io.StringIO(), io.StringIO()
    write_stream([PrefillProgress(1, 2, 300), PrefillProgress(2, 2, 300), "Hel", "lo"], out, err)
    assert out.getvalue() == "Hello"
    assert "prefill 2/2 layers (300 tokens)" in err.getvalue() and err.getvalue().endswith("\r\033[K")


def test_generate_and_serve_stream_weights_beyond_a_resident_size(engine, capsys):
    """`--weights-resident 16MiB`: the reply is the same with most weights streamed; `serve` passes the
    size on; sizes take units, and a bad one fails clearly."""
    import argparse

    import pytest

    from deploy.cli import build_parser, byte_size
    from deploy.server import options_from_args

    expected = engine.call(engine.new_ctx(), PROMPT, max_tokens=8).text
    code, out, err = run_here(capsys, "generate", "--chat", "--prompt", PROMPT, "--max-tokens", "8",
                              "--weights-resident", "16MiB")
    assert code == 0, err
    assert out == expected + "\n"
    args = build_parser().parse_args(["serve", "--weights-resident", "64M", "--prefill-budget", "32MiB",
                                      "--kv-budget", "1.5GB", "--data-dir", "/tmp/unused"])
    opts = options_from_args(args)
    assert (opts["weights_resident_bytes"], opts["prefill_budget_bytes"], opts["pool_bytes"]) == (
        64 << 20, 32 << 20, 1_500_000_000)
    assert byte_size("4096") == 4096 and byte_size("2 KiB") == 2048 and byte_size("0") == 0
    for bad in ("lots", "12XB", "-3M"):
        with pytest.raises(argparse.ArgumentTypeError):
            byte_size(bad)
    code, out, err = run_here(capsys, "generate", "--prompt", "x", "--weights-resident", "many")
    assert code == 2 and "is not a size" in err


def test_generate_with_lookup_decoding_prints_the_same_reply(engine, capsys):
    """Lookup decoding is on by default (`--lookup-draft 4`): the greedy reply of a plain decode, as with
    `--lookup-draft 0`; a negative length fails clearly."""
    prompt = "Repeat twice: one two three four five six."
    expected = engine.call(engine.new_ctx(), prompt, max_tokens=24).text
    for extra in ([], ["--lookup-draft", "0"]):
        code, out, err = run_here(capsys, "generate", "--chat", "--prompt", prompt, "--max-tokens", "24", *extra)
        assert code == 0, err
        assert out == expected + "\n"
    code, out, err = run_here(capsys, "generate", "--prompt", "x", "--lookup-draft", "-1")
    assert code == 2 and "lookup_draft must be >= 0" in err


def test_the_in_process_commands_set_a_short_openmp_spin_before_torch_loads():
    """`generate` and `chat` run torch in this process: libgomp reads its spin as torch loads it, so
    the CLI sets it first (and leaves a user's own setting alone)."""
    import os
    import subprocess
    import sys

    from actors.config import OPENMP_SPIN

    code = ("import os, sys; from deploy import cli; cli._openmp_spin(); "
            "print(os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(OPENMP_SPIN), "False"]
    out = subprocess.run([sys.executable, "-c", code], env={**env, "OMP_WAIT_POLICY": "ACTIVE"},
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["None", "False"]
