"""Issue 28's done-when, end to end: a long prompt through `llmaas serve --policy vllm-s` with a small KV
budget (`--kv-budget` and `--prefill-budget`, so the prefill and the reply's decode stream the K/V
layer by layer), against the same server without budgets; then a second turn on the same context. The
replies must be identical; TTFT and the wall time of each call are printed beside them.

    python -m bench.serve_long_prompt [--tokens 5950] [--budget-mib 32] [--max-tokens 32]

It starts each server on its own data directory (a temporary folder, removed after a run that succeeded)
and port, and stops it after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def _request(port: int, path: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=1800) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        raise SystemExit(f"{path}: HTTP {e.code}: {e.read()[:2000].decode(errors='replace')}") from e


def _actor_memory(actor: str) -> tuple[float, float]:
    """(RSS, peak RSS) in MiB of the running process whose title names `actor` (Ray titles its actor
    processes `ray::<Class>...`), from /proc/<pid>/status; zeros when none is found."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(f"ray::{actor}".encode()):
                    continue
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue
        return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024
    return 0.0, 0.0


def _written(port: int, ctx: str, token: str) -> dict:
    """The context's chunks once its last write-back is done (nothing left only in memory to write,
    for a server with budgets; at most 10 minutes)."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/contexts/{ctx}", headers={"Authorization": f"Bearer {token}"})
    for _ in range(600):
        with urllib.request.urlopen(req, timeout=60) as r:
            chunks = json.load(r)["chunks"]
        if chunks["to_recompute"] == 0:
            break
        time.sleep(1)
    return chunks


def _serve(extra: list[str], port: int, prompt: str, a) -> list[dict]:
    d = tempfile.mkdtemp(prefix="serve-long-")
    cmd = [sys.executable, "-m", "deploy.cli", "serve", "--data-dir", d, "--port", str(port),
           "--policy", "vllm-s"] + extra
    with open(os.path.join(d, "server.log"), "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    ok = False
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except OSError:
                if p.poll() is not None:
                    raise SystemExit(f"the server stopped; see {d}/server.log")
                time.sleep(1)
        with open(os.path.join(d, "admin_token")) as f:
            admin = f.read().strip()
        app = _request(port, "/v1/apps", {"name": "docs"}, admin)["token"]
        ctx = _request(port, "/v1/contexts", {}, app)["id"]
        started = _actor_memory("ExecutorActor")[0]
        out = []
        for text, n in ((prompt, a.max_tokens), ("Who would read it, and why?", a.max_tokens)):
            t = time.perf_counter()
            r = _request(port, f"/v1/contexts/{ctx}/calls", {"prompt": text, "max_tokens": n}, app)
            r["wall_s"] = time.perf_counter() - t
            out.append(r)
        chunks = _written(port, ctx, app)
        rss, peak = _actor_memory("ExecutorActor")
        out[-1]["executor_mib"] = (started, rss, peak)
        out[-1]["chunks"] = chunks
        ok = True
        return out
    finally:
        os.killpg(p.pid, signal.SIGINT)
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
        if ok:
            shutil.rmtree(d, ignore_errors=True)  # its chunk files: hundreds of MB a run
        else:
            print(f"the server's data directory and log are kept in {d}", file=sys.stderr)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=5950, help="tokens of held-out text in the prompt")
    ap.add_argument("--budget-mib", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8071)
    a = ap.parse_args(argv)
    from bench.accuracy import machine_line, real_text_ids
    from engine.chat import ChatTokenizer
    from engine.loader import resolve_model

    t0 = time.perf_counter()
    tok = ChatTokenizer(resolve_model(None).directory)
    prompt = tok.decode(real_text_ids(tok)[: a.tokens]) + "\n\nIn one sentence, what is this text about?"
    budget = str(a.budget_mib << 20)
    small = _serve(["--kv-budget", budget, "--prefill-budget", budget], a.port, prompt, a)
    plain = _serve([], a.port + 1, prompt, a)
    cmd = "python -m bench.serve_long_prompt " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{cmd.strip()}`. {machine_line()}. Total runtime {time.perf_counter() - t0:.0f} s.\n")
    print("| server | call | prompt tokens attended | TTFT, s | call, s | reply |\n|---|---:|---:|---:|---:|---|")
    for name, runs in ((f"--kv-budget/--prefill-budget {a.budget_mib} MiB", small), ("no budget", plain)):
        for i, r in enumerate(runs, 1):
            print(f"| {name} | {i} | {r['usage']['prompt_tokens']} | {r['ttft_ms'] / 1e3:.1f} | {r['wall_s']:.1f} | "
                  f"{r['text'][:60]!r} |")
    same = [s["text"] for s in small] == [p["text"] for p in plain]
    print(f"\nReplies identical: {same}\n")
    print("| server | executor RSS at start, MiB | after, MiB | peak, MiB | chunks resident | on disk |\n"
          "|---|---:|---:|---:|---|---|")
    for name, runs in ((f"{a.budget_mib} MiB budgets", small), ("no budget", plain)):
        started, rss, peak = runs[-1]["executor_mib"]
        ch = runs[-1]["chunks"]
        print(f"| {name} | {started:.0f} | {rss:.0f} | {peak:.0f} | {ch['resident']} | {ch['swapped']} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
