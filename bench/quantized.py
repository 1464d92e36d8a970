"""Decode and prefill speed and resident memory per weight format, against transformers (float32)
and llama.cpp (`llama-cpp-python`, when installed) on the same weights and the same cores.

Systems, each run in a subprocess of its own, in an order rotated from round to round (medians over
rounds are reported):

- `engine:FORMAT` (fp32, bf16, int8, int4, ...): the engine as the service runs it (information
  density on), on the GGUF named for that format;
- `transformers`: float32, SDPA attention, inference mode, as `bench.engine_speed` runs it;
- `llama.cpp:GGUF` on the same GGUF files (Q4_0 for int4 group 32, Q8_0 for int8).

Models: `default` (SmolLM2-135M-Instruct: its Q4_1 GGUF for the engine's fp32/bf16/int4, Q4_0 and Q8_0
GGUFs written from it for the like-for-like rows) and `1b` (Llama-3.2-1B's shape with SmolLM2's
vocabulary, random weights written by `bench.model_files`).

With `--write`, the results replace this machine's kind's block of the page (`host_kind`: one block per
kind of CPU, e.g. `<!-- quantized:Xeon-AMX:begin -->`), so a run on one kind leaves the others' as they are.

    python -m bench.quantized [--models default 1b] [--rounds 3] [--threads 2] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.serve_long_prompt import proc_status
from engine.native import cpu_model_and_flags

NAME = "quantized"
HEADING = "## Quantized weights"
PREFILL = (512, 2048)  # prompt lengths whose prefill is timed (--prefill-tokens)
DECODE_PROMPT = 256


def _ids(n: int, seed: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(seed).integers(100, 40000, n).tolist()


# ---- workers (one system per process) ------------------------------------------------------------------


def _rates(times: dict[int, list[float]]) -> dict[str, float]:
    """Prefill tokens/s per prompt length (JSON keys are strings) from the timed repeats."""
    return {str(n): n / statistics.median(ts) for n, ts in times.items()}


def work_engine(model: str, weights: str, repeats: int, decode: int, lengths: list[int]) -> dict:
    import torch

    from engine.config import EngineConfig
    from engine.loader import resolve_model
    from engine.model import Transformer

    resolved = resolve_model(model, progress=False)
    m = Transformer.from_directory(resolved.directory, EngineConfig(device="cpu", weights=weights),
                                   fingerprint=resolved.fingerprint)
    m.warmup()
    prefill, dec = {n: [] for n in lengths}, []
    with torch.inference_mode():
        for n in lengths:
            ids = _ids(n, 0)
            for r in range(repeats + 1):
                cache = m.new_cache(n)
                t = time.perf_counter()
                m.forward(cache, ids, density=torch.zeros(n))
                if r:
                    prefill[n].append(time.perf_counter() - t)
        ctx = _ids(DECODE_PROMPT, 1)
        for r in range(repeats + 1):
            cache = m.new_cache(DECODE_PROMPT + decode + 16)
            logits = m.forward(cache, ctx, density=torch.zeros(DECODE_PROMPT))
            t = time.perf_counter()
            for i in range(decode):
                logits = m.forward(cache, [int(logits.argmax())], density=torch.zeros(DECODE_PROMPT + 1 + i))
            if r:
                dec.append(time.perf_counter() - t)
    return {"prefill": _rates(prefill), "decode": decode / statistics.median(dec),
            "rss": proc_status(), "weights": m.weight_format}


def work_transformers(model_dir: str, repeats: int, decode: int, lengths: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    prefill, dec = {n: [] for n in lengths}, []
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor([_ids(n, 0)])
            for r in range(repeats + 1):
                t = time.perf_counter()
                hf(ids, use_cache=True, logits_to_keep=1)
                if r:
                    prefill[n].append(time.perf_counter() - t)
        ctx = torch.tensor([_ids(DECODE_PROMPT, 1)])
        for r in range(repeats + 1):
            out = hf(ctx, past_key_values=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1)
            t = time.perf_counter()
            for _ in range(decode):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
            if r:
                dec.append(time.perf_counter() - t)
    return {"prefill": _rates(prefill), "decode": decode / statistics.median(dec), "rss": proc_status()}


def work_llamacpp(gguf: str, repeats: int, decode: int, threads: int, lengths: list[int]) -> dict:
    import numpy as np
    from llama_cpp import Llama

    longest = max(lengths)
    llm = Llama(model_path=gguf, n_ctx=max(1024, longest), n_batch=longest, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, logits_all=False, verbose=False)
    prefill, dec = {n: [] for n in lengths}, []
    for n in lengths:
        ids = _ids(n, 0)
        for r in range(repeats + 1):
            llm.reset()
            t = time.perf_counter()
            llm.eval(ids)
            if r:
                prefill[n].append(time.perf_counter() - t)
    ctx = _ids(DECODE_PROMPT, 1)
    for r in range(repeats + 1):
        llm.reset()
        llm.eval(ctx)
        t = time.perf_counter()
        for _ in range(decode):
            llm.eval([int(np.argmax(llm.scores[llm.n_tokens - 1]))])
        if r:
            dec.append(time.perf_counter() - t)
    return {"prefill": _rates(prefill), "decode": decode / statistics.median(dec), "rss": proc_status()}


# ---- driver ---------------------------------------------------------------------------------------------


def model_files(name: str, root: Path) -> dict[str, str]:
    """Paths per role for a model: `gguf:<TYPE>` files, `hf` (a checkpoint directory for transformers)."""
    from bench import model_files as mf
    from engine.loader import default_model_path, resolve_model

    if name == "default":
        src = default_model_path()
        out = {"gguf:Q4_1": str(src), "hf": str(resolve_model(progress=False).directory)}
        for q in ("Q4_0", "Q8_0"):
            dst = root / f"default-{q}.gguf"
            if not dst.is_file():
                mf.requantize(src, dst, q)
            out[f"gguf:{q}"] = str(dst)
        return out
    d = mf.random_model(root / name, **mf.SHAPE_1B)
    return {"gguf:Q4_0": str(d / "model-Q4_0.gguf"), "gguf:Q8_0": str(d / "model-Q8_0.gguf"), "hf": str(d / "hf")}


def systems(files: dict[str, str], have_llamacpp: bool, formats: list[str]) -> dict[str, list[str]]:
    """System label -> worker arguments."""
    out = {"transformers fp32": ["transformers", files["hf"]]}
    for fmt in formats:
        if fmt in ("fp32", "bf16"):
            out[f"engine {fmt}"] = ["engine", files.get("gguf:Q4_1", files["hf"]), fmt]
        elif fmt == "int8":
            out["engine int8 (Q8_0 GGUF)"] = ["engine", files["gguf:Q8_0"], "int8"]
        elif fmt == "int4":
            out["engine int4 (Q4_0 GGUF)"] = ["engine", files["gguf:Q4_0"], "int4"]
            if "gguf:Q4_1" in files:
                out["engine int4 (Q4_1 GGUF)"] = ["engine", files["gguf:Q4_1"], "int4"]
        else:
            out[f"engine {fmt}"] = ["engine", files.get("gguf:Q4_1", files["gguf:Q4_0"]), fmt]
    if have_llamacpp:
        for q in ("Q4_0", "Q8_0"):
            out[f"llama.cpp {q}"] = ["llama.cpp", files[f"gguf:{q}"]]
    return out


def run_worker(args: list[str], repeats: int, decode: int, threads: int, lengths: list[int]) -> dict:
    cmd = [sys.executable, "-m", "bench.quantized", "--worker", *args, "--repeats", str(repeats),
           "--decode-tokens", str(decode), "--threads", str(threads), "--prefill-tokens", *map(str, lengths)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise RuntimeError(f"{' '.join(args)} failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def cpu_line() -> str:
    model, flags = cpu_model_and_flags()
    caches = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            k, _, v = line.partition(":")
            if k.strip() in ("L1d cache", "L2 cache", "L3 cache"):
                caches[k.strip().split()[0]] = v.strip()
    except OSError:
        pass
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_vnni", "avx2") if f in flags]
    return f"{model}; {', '.join(f'{k} {v}' for k, v in caches.items())}; {' '.join(isa)}"


def host_kind() -> str:
    """This CPU's kind as the results page's machine table names it, for the page's per-host blocks:
    the model's family (Xeon, EPYC, ...) and its widest bfloat16 products: "Xeon-AMX",
    "EPYC-AVX512", or the family alone."""
    model, flags = cpu_model_and_flags()
    words = model.split() or [platform.machine()]
    family = next((w for w in ("Xeon", "EPYC", "Ryzen", "Core") if w in words), words[0])
    return family + ("-AMX" if "amx_bf16" in flags else "-AVX512" if "avx512_bf16" in flags else "")


def markdown(results: dict, args, seconds: float) -> str:
    lines = [f"Command: `python -m bench.quantized --models {' '.join(args.models)} --formats {' '.join(args.formats)} "
             f"--rounds {args.rounds} --repeats {args.repeats} --threads {args.threads} "
             f"--decode-tokens {args.decode_tokens} --prefill-tokens {' '.join(map(str, args.prefill_tokens))}`. Date: {datetime.date.today()}. "
             f"Machine: {os.cpu_count()} cores, {cpu_line()}. Each system in its own process, {args.threads} "
             f"threads, order rotated over {args.rounds} rounds; medians of the rounds (each round the median of "
             f"{args.repeats} repeats). Prefill: prompts of random tokens; decode: {args.decode_tokens} tokens "
             f"after a {DECODE_PROMPT}-token prompt. Resident memory at the end of the runs. Run took {seconds / 60:.0f} min.",
             ""]
    lengths = [str(n) for n in args.prefill_tokens]

    def prefill(a: dict, b: dict) -> str:
        return ", ".join(f"{a['prefill'][n] / b['prefill'][n]:.2f}x at {n} tokens" for n in lengths)

    for model, rows in results.items():
        ref = rows["transformers fp32"]
        lcpp = {k: v for k, v in rows.items() if k.startswith("llama.cpp")}
        lines += [f"Model `{model}`:", "",
                  "| system | decode, tok/s | vs transformers | "
                  + " | ".join(f"prefill {n}, tok/s | vs transformers" for n in lengths) + " | RSS, MB (anon / file) |",
                  "|---|---:|---:|" + "---:|---:|" * len(lengths) + "---|"]
        for label, r in rows.items():
            rss = r["rss"]
            lines.append(f"| {label} | {r['decode']:.1f} | {r['decode'] / ref['decode']:.2f}x | "
                         + " | ".join(f"{r['prefill'][n]:.0f} | {r['prefill'][n] / ref['prefill'][n]:.2f}x" for n in lengths)
                         + f" | {rss['VmRSS'] >> 20} ({rss['RssAnon'] >> 20} / {rss['RssFile'] >> 20}) |")
        for q, fmt in (("Q4_0", "engine int4 (Q4_0 GGUF)"), ("Q8_0", "engine int8 (Q8_0 GGUF)")):
            if f"llama.cpp {q}" in lcpp and fmt in rows:
                lines.append(f"\n{fmt} against llama.cpp {q}: decode {rows[fmt]['decode'] / lcpp[f'llama.cpp {q}']['decode']:.2f}x, "
                             f"prefill {prefill(rows[fmt], lcpp[f'llama.cpp {q}'])}.")
        if "engine bf16" in rows and "engine fp32" in rows:
            lines.append(f"\nengine bf16 against engine fp32: prefill {prefill(rows['engine bf16'], rows['engine fp32'])}.")
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Workers: --worker engine MODEL FORMAT | transformers DIR | llama.cpp GGUF")
    ap.add_argument("--models", nargs="+", default=["default"], choices=["default", "1b"])
    ap.add_argument("--formats", nargs="+", default=["fp32", "bf16", "int8", "int4"],
                    help="engine weight formats (default fp32 bf16 int8 int4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the system order rotates (default 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats inside a worker (default 3)")
    ap.add_argument("--decode-tokens", type=int, default=64, help="decode steps (default 64)")
    ap.add_argument("--threads", type=int, default=2, help="threads every system uses (default 2)")
    ap.add_argument("--prefill-tokens", type=int, nargs="+", default=list(PREFILL), metavar="N",
                    help="prompt lengths whose prefill is timed (default 512 2048)")
    ap.add_argument("--files", type=Path, default=Path(os.environ.get("LLMAAS_CACHE_DIR", Path.home() / ".cache/llmaas")) / "bench-models",
                    help="where the model files are written (default: the model cache's bench-models)")
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama.cpp even when installed")
    ap.add_argument("--write", type=Path, help="replace this benchmark's section of a markdown file")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker:
        import torch

        torch.set_num_threads(args.threads)
        kind, *rest = args.worker
        if kind == "engine":
            res = work_engine(rest[0], rest[1], args.repeats, args.decode_tokens, args.prefill_tokens)
        elif kind == "transformers":
            res = work_transformers(rest[0], args.repeats, args.decode_tokens, args.prefill_tokens)
        else:
            res = work_llamacpp(rest[0], args.repeats, args.decode_tokens, args.threads, args.prefill_tokens)
        print(json.dumps(res))
        return 0

    import importlib.util

    have = importlib.util.find_spec("llama_cpp") is not None and not args.no_llamacpp
    if importlib.util.find_spec("llama_cpp") is None:
        print("bench.quantized: llama-cpp-python is not installed: no llama.cpp rows "
              "(pyproject.toml's `bench` extra builds it)", file=sys.stderr)
    t0 = time.perf_counter()
    args.files.mkdir(parents=True, exist_ok=True)
    results = {}
    for model in args.models:
        files = model_files(model, args.files)
        sysmap = systems(files, have, args.formats)
        labels = list(sysmap)
        samples: dict[str, list[dict]] = {k: [] for k in labels}
        for r in range(args.rounds):
            order = labels[r % len(labels):] + labels[: r % len(labels)]
            for label in order:
                res = run_worker(sysmap[label], args.repeats, args.decode_tokens, args.threads, args.prefill_tokens)
                samples[label].append(res)
                rates = ", ".join(f"{t:.0f} at {n}" for n, t in res["prefill"].items())
                print(f"{model} round {r + 1} {label}: decode {res['decode']:.1f} tok/s, prefill tok/s {rates}",
                      file=sys.stderr)
        results[model] = {k: {"decode": statistics.median(s["decode"] for s in v),
                              "prefill": {n: statistics.median(s["prefill"][n] for s in v) for n in v[0]["prefill"]},
                              "rss": v[-1]["rss"]}
                          for k, v in samples.items()}
    from bench.markdown import publish

    return publish(markdown(results, args, time.perf_counter() - t0), args.write, f"{NAME}:{host_kind()}", HEADING)


if __name__ == "__main__":
    sys.exit(main())
