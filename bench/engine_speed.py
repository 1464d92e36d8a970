"""Engine speed against Hugging Face transformers on the same weights, in one script.

Measures prefill tokens/s at 512 and 2048 tokens and decode tokens/s for (a) the engine as the service
runs it (information density on; attention in the compiled kernel of engine/attention.c when it builds),
(b) the engine without density, (c) the engine with density in its torch blockwise kernel (the
fallback), (d) the engine with torch's fused attention (no density), and (e) transformers (SDPA
attention, KV cache). Runs are interleaved so that
background load affects every variant alike; the median of the repeats is reported. Also measures cold
and warm model load in fresh subprocesses.

    python -m bench.engine_speed [--repeats 5] [--decode-tokens 128] [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BEGIN, END = "<!-- engine-speed:begin -->", "<!-- engine-speed:end -->"


def load_times() -> dict[str, float]:
    """Cold (convert the GGUF into an empty cache) and warm (cache hit) load, each in a fresh process."""
    code = (
        "import time,sys; t=time.perf_counter(); from engine.context import ContextEngine; "
        "e=ContextEngine.load(progress=False); print(time.perf_counter()-t)"
    )
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, LLMAAS_CACHE_DIR=tmp, HF_HUB_OFFLINE="1")
        for name in ("cold", "warm"):
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            out[name] = float(r.stdout.strip().splitlines()[-1])
            out[name + "_process"] = time.perf_counter() - t0
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="timed repeats per variant (default 5)")
    ap.add_argument("--decode-tokens", type=int, default=128, help="decode steps per decode run (default 128)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048], help="prefill lengths in tokens")
    ap.add_argument("--no-load", action="store_true", help="skip the cold/warm load measurement")
    ap.add_argument("--stat", choices=("median", "best"), default="median",
                    help="summary of the repeats (default median; best: the least disturbed run, for a noisy shared machine)")
    ap.add_argument("--write", type=Path, help="replace the engine-speed section of this markdown file")
    args = ap.parse_args(argv)

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
    from transformers.utils import logging as hf_logging

    from engine.loader import resolve_model
    from engine.model import Transformer

    summary = statistics.median if args.stat == "median" else min
    hf_logging.disable_progress_bar()
    loads = {} if args.no_load else load_times()
    resolved = resolve_model(progress=False)
    eng = Transformer.from_directory(resolved.directory)
    hf = AutoModelForCausalLM.from_pretrained(str(resolved.directory), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(0)

    def eng_prefill(ids, mode, native=True):
        eng.engine_cfg.native_attention = native
        try:
            cache = eng.new_cache(len(ids))
            dens = torch.zeros(len(ids)) if mode == "density" else None
            eng.forward(cache, ids, density=dens, sdpa=(mode == "sdpa"))
        finally:
            eng.engine_cfg.native_attention = True

    def hf_prefill(ids):
        hf(torch.tensor([ids]), use_cache=True, logits_to_keep=1)

    variants = {
        "engine (density on)": lambda ids: eng_prefill(ids, "density"),
        "engine (density off)": lambda ids: eng_prefill(ids, "off"),
        "engine (density on, torch kernel)": lambda ids: eng_prefill(ids, "density", native=False),
        "engine (fused SDPA, no density)": lambda ids: eng_prefill(ids, "sdpa"),
        "transformers (SDPA)": hf_prefill,
    }
    prefill: dict[tuple[str, int], float] = {}
    with torch.inference_mode():
        for n in args.lengths:
            ids = torch.randint(100, 40000, (n,), generator=gen).tolist()
            times = {k: [] for k in variants}
            for f in variants.values():
                f(ids)  # warm up
            for _ in range(args.repeats):
                for k, f in variants.items():
                    t = time.perf_counter()
                    f(ids)
                    times[k].append(time.perf_counter() - t)
            for k in variants:
                prefill[(k, n)] = n / summary(times[k])
            print(f"prefill {n} (tok/s, median / best): " + ", ".join(
                f"{k} {n / statistics.median(times[k]):.0f} / {n / min(times[k]):.0f}" for k in variants), file=sys.stderr)

        ctx_ids = torch.randint(100, 40000, (256,), generator=gen).tolist()
        steps = args.decode_tokens

        def eng_decode():
            cache = eng.new_cache(256 + steps + 16)
            dens = torch.zeros(256)
            logits = eng.forward(cache, ctx_ids, density=dens)
            t = time.perf_counter()
            for i in range(steps):
                logits = eng.forward(cache, [int(logits.argmax())], density=torch.zeros(257 + i))
            return time.perf_counter() - t

        def hf_decode():
            cache = DynamicCache(config=hf.config)
            out = hf(torch.tensor([ctx_ids]), past_key_values=cache, use_cache=True, logits_to_keep=1)
            t = time.perf_counter()
            for _ in range(steps):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
            return time.perf_counter() - t

        dec = {"engine (density on)": [], "transformers (SDPA)": []}
        eng_decode(), hf_decode()
        for _ in range(max(2, args.repeats // 2)):
            dec["engine (density on)"].append(eng_decode())
            dec["transformers (SDPA)"].append(hf_decode())
        decode = {k: steps / summary(v) for k, v in dec.items()}
        print("decode: " + ", ".join(f"{k} {v:.1f} tok/s" for k, v in decode.items()), file=sys.stderr)

    ref = "transformers (SDPA)"
    lines = [
        BEGIN,
        f"Command: `python -m bench.engine_speed --repeats {args.repeats} --decode-tokens {steps}"
        + f" --lengths {' '.join(map(str, args.lengths))}" + (" --no-load" if args.no_load else "")
        + (" --stat best" if args.stat == "best" else "") + "`. "
        f"Date: {datetime.date.today().isoformat()}. Machine: {os.cpu_count()} cores, {platform.machine()}, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), float32 on CPU. "
        f"{'Median' if args.stat == 'median' else 'Best'} of {args.repeats} interleaved repeats; random token ids.",
        "",
        "| prefill | " + " | ".join(f"{n} tokens (tok/s)" for n in args.lengths) + " | ratio to transformers |",
        "|---|" + "---|" * len(args.lengths) + "---|",
    ]
    for k in variants:
        ratio = ", ".join(f"{prefill[(k, n)] / prefill[(ref, n)]:.2f}x" for n in args.lengths)
        lines.append(f"| {k} | " + " | ".join(f"{prefill[(k, n)]:.0f}" for n in args.lengths) + f" | {ratio} |")
    lines += [
        "",
        "Density cost (share of prefill time spent on it, engine with vs without): "
        + ", ".join(
            f"{n} tokens {1 - prefill[('engine (density on)', n)] / prefill[('engine (density off)', n)]:.1%}"
            for n in args.lengths
        )
        + "; against the fused-attention engine: "
        + ", ".join(
            f"{n} tokens {1 - prefill[('engine (density on)', n)] / prefill[('engine (fused SDPA, no density)', n)]:.1%}"
            for n in args.lengths
        )
        + ".",
        "",
        f"| decode ({steps} tokens after a 256-token prompt) | tok/s | ratio |",
        "|---|---|---|",
    ]
    for k, v in decode.items():
        lines.append(f"| {k} | {v:.1f} | {v / decode[ref]:.2f}x |")
    if loads:
        lines += [
            "",
            f"Model load (default SmolLM2-135M-Instruct, fresh process): cold (de-quantize the GGUF and write the "
            f"cache) {loads['cold']:.1f} s, warm (cache hit) {loads['warm']:.1f} s "
            f"(whole process including interpreter start and imports: {loads['cold_process']:.1f} s and "
            f"{loads['warm_process']:.1f} s).",
        ]
    lines.append(END)
    text = "\n".join(lines)
    print(text)
    if args.write:
        doc = args.write.read_text() if args.write.exists() else "# Benchmarks\n"
        if BEGIN in doc:
            doc = doc[: doc.index(BEGIN)] + text + doc[doc.index(END) + len(END) :]
        else:
            doc = doc.rstrip("\n") + "\n\n## Engine speed\n\n" + text + "\n"
        args.write.write_text(doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
