"""Issue 28's done-when, end to end: a long prompt through `llmaas serve --policy vllm-s` with a small KV
budget (`--kv-budget` and `--prefill-budget`, so the prefill and the reply's decode stream the K/V
layer by layer), against the same server without budgets; then a second turn on the same context. The
replies must be identical; TTFT and the wall time of each call are printed beside them.

    python -m bench.serve_long_prompt [--tokens 5950] [--budget-mib 32] [--max-tokens 32]

Beside each call a thread of this script samples, every 50 ms until the call's write-back is on disk,
what the memory of each process the K/V passes through (executor, recompute worker, IO worker) and the
object store's pages in /dev/shm rose above their values when the call began: the budget measured
across processes (`MemorySampler`), not only the executor's RSS.

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
import threading
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


ACTORS = ("ExecutorActor", "RecomputeActor", "IOActor")
"""The processes a long call's K/V passes through: the model executor, the recompute worker (which
restores into the same working set) and the KV swap/IO worker."""
KINDS = ("RssAnon", "RssFile", "RssShmem")
"""Per process, from /proc/<pid>/status: private memory (tensors, numpy buffers, the allocator's
arenas), file pages mapped (the weights, the streamed working set's file), and shared memory mapped
(the object store's pages, a /dev/shm working set)."""


def _actor_pids() -> dict[str, int]:
    """Actor class name -> pid of the running process Ray titles `ray::<Class>...`."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        for actor in ACTORS:
            if title.startswith(f"ray::{actor}".encode()):
                out.setdefault(actor, int(pid))
    return out


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """A process's VmRSS, VmHWM and `KINDS` in bytes, from /proc/<pid>/status (zeros once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
    except OSError:
        return dict.fromkeys(("VmRSS", "VmHWM") + KINDS, 0)
    return {k: int(fields[k].split()[0]) << 10 for k in ("VmRSS", "VmHWM") + KINDS}


def _shm_used() -> int:
    """Bytes used in /dev/shm, where Ray's object store keeps its objects' pages."""
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


class MemorySampler:
    """The budget measured across processes: every `period_s`, each actor's `KINDS` and /dev/shm's used
    bytes; `peaks()` gives the most each rose above its first sample, and the most their sum did. A
    thread of the benchmark's own, reading /proc, so nothing in the service is instrumented."""

    def __init__(self, period_s: float = 0.05):
        self.period_s = period_s
        self.pids = _actor_pids()
        self.base = self._sample()
        self.peak = dict.fromkeys(self.base, 0)
        self.peak_sum = 0
        self.at_peak = dict.fromkeys(self.base, 0)
        """Each rise at the instant the sum peaked."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> dict[str, int]:
        out = {"/dev/shm": _shm_used()}
        for actor, pid in self.pids.items():
            st = proc_status(pid)
            out.update({f"{actor} {k}": st[k] for k in KINDS})
        return out

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            rise = {k: v - self.base[k] for k, v in self._sample().items()}
            for k, v in rise.items():
                self.peak[k] = max(self.peak[k], v)
            # a process's RssShmem is pages of /dev/shm (the object store's) it maps: counted once, there
            total = sum(max(v, 0) for k, v in rise.items()
                        if not k.endswith("RssShmem"))
            if total > self.peak_sum:
                self.peak_sum, self.at_peak = total, rise

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


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
        executor = _actor_pids()["ExecutorActor"]
        started = proc_status(executor)["VmRSS"]
        out = []
        for text, n in ((prompt, a.max_tokens), ("Who would read it, and why?", a.max_tokens)):
            t = time.perf_counter()
            with MemorySampler() as sampler:
                r = _request(port, f"/v1/contexts/{ctx}/calls", {"prompt": text, "max_tokens": n}, app)
                r["wall_s"] = time.perf_counter() - t
                r["chunks"] = _written(port, ctx, app)
            r["memory"] = sampler
            out.append(r)
        st = proc_status(executor)
        out[-1]["executor_mib"] = (started / 2**20, st["VmRSS"] / 2**20, st["VmHWM"] / 2**20)
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
    print("\nThe budget across processes: the most each process's memory rose above its value when the call "
          "began, sampled every 50 ms from the call until its write-back is on disk (MiB; the sum's peak is "
          "of the rises at one instant, each process's RssShmem left out: those are /dev/shm's pages):\n")
    keys = list(small[0]["memory"].peak)
    print("| server | call | " + " | ".join(keys) + " | sum, peak | budget |\n|---|---:|" + "---:|" * (len(keys) + 2))
    for name, runs, budget_mib in ((f"{a.budget_mib} MiB budgets", small, a.budget_mib), ("no budget", plain, None)):
        for i, r in enumerate(runs, 1):
            m = r["memory"]
            cells = " | ".join(f"{m.peak.get(k, 0) / 2**20:.0f}" for k in keys)
            print(f"| {name} | {i} | {cells} | {m.peak_sum / 2**20:.0f} | {budget_mib or '-'} |")
            cells = " | ".join(f"{m.at_peak.get(k, 0) / 2**20:.0f}" for k in keys)
            print(f"| {name}, at the sum's peak | {i} | {cells} | {m.peak_sum / 2**20:.0f} | {budget_mib or '-'} |")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
