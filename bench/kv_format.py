"""The kv8 working set (keys int8, values fp8 e4m3, one scale per token and head; MNN-LLM §4.2) against
the float one, on the default model: memory, perplexity, decode speed, and how its errors compound
when the planner lowers a chunk to q4/q2.

- Memory: bytes of a working set of `--context` tokens in each format.
- Perplexity: on the benchmark suite's held-out text (`bench.accuracy.real_text_ids`), `--windows`
  windows of `--width` tokens, every layer's attention reading K/V back from the working set.
- Decode: ms per token after a prefill of `--context` tokens, the formats alternated for `--rounds`
  rounds (medians).
- Compounding: relative RMS error against the float K/V of `--context` tokens of real text, of kv8
  alone, of q4/q2 encoded from float, and of q4/q2 encoded from kv8 rows and decoded back into them.

    python -m bench.kv_format [--context 2048] [--windows 6] [--width 384] [--rounds 5] [--weights fp32]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time


def perplexity(model, ids, fmt: str, windows: int, width: int) -> float:
    import torch

    from bench.accuracy import window_starts

    nll, count = 0.0, 0
    for s in window_starts(len(ids), windows, width):
        w = ids[s : s + width]
        logits = model.forward(model.new_cache(width, fmt), w, all_logits=True)
        lp = torch.log_softmax(logits[:-1].float(), dim=-1)
        nll -= float(lp.gather(1, torch.tensor(w[1:]).unsqueeze(1)).sum())
        count += width - 1
    return math.exp(nll / count)


def decode_ms(model, ids, fmt: str, context: int, tokens: int = 32) -> float:
    cache = model.new_cache(context + tokens, fmt)
    model.forward(cache, ids[:context])
    t = time.perf_counter()
    for i in range(tokens):
        model.forward(cache, [ids[context + i]])
    return (time.perf_counter() - t) / tokens * 1e3


def compounding(model, ids, context: int) -> dict[str, tuple[float, float]]:
    """level -> (keys, values) relative RMS error against the float K/V."""
    import numpy as np
    import torch

    from engine import kvformat
    from storage import codecs

    cache = model.new_cache(context, "float")
    model.forward(cache, ids[:context])
    kv = np.concatenate([cache.export_chunk(i) for i in range(cache.n_chunks)], axis=3)
    rows = kvformat.pack(torch.from_numpy(kv)).numpy()

    def rel(y):
        return tuple(float(np.linalg.norm(y[:, p] - kv[:, p]) / np.linalg.norm(kv[:, p])) for p in (0, 1))

    def chunked(src, level):
        return np.concatenate([codecs.decode(codecs.encode(np.ascontiguousarray(src[:, :, :, s : s + 16]), level))
                               for s in range(0, src.shape[3], 16)], axis=3)

    out = {"kv8": rel(kvformat.unpack(torch.from_numpy(rows)).numpy())}
    for level in ("q4", "q2"):
        out[f"{level} from float"] = rel(chunked(kv, level))
        out[f"{level} from kv8"] = rel(kvformat.unpack(torch.from_numpy(chunked(rows, level))).numpy())
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=2048, help="tokens before decode, and of the compounding probe")
    ap.add_argument("--windows", type=int, default=6, help="perplexity windows (default 6)")
    ap.add_argument("--width", type=int, default=384, help="tokens per perplexity window (default 384)")
    ap.add_argument("--rounds", type=int, default=5, help="decode rounds per format, alternated (default 5)")
    ap.add_argument("--weights", default="fp32", help="weight format (default fp32)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch

    from bench.accuracy import machine_line, real_text_ids
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    torch.set_num_threads(a.threads)
    engine = ContextEngine.load(None, EngineConfig(weights=a.weights), progress=False)
    model = engine.model
    ids = real_text_ids(engine.tok)
    if len(ids) < a.context + 32:
        ap.error(f"--context {a.context}: the held-out text has {len(ids)} tokens")
    fmts = ("float", "kv8")
    nbytes = {f: model.new_cache(a.context, f).nbytes() for f in fmts}
    ppl = {f: perplexity(model, ids, f, a.windows, a.width) for f in fmts}
    decode_ms(model, ids, "kv8", 64)  # warm the kernels
    ms = {f: [] for f in fmts}
    for r in range(a.rounds):
        for f in fmts if r % 2 == 0 else fmts[::-1]:
            ms[f].append(decode_ms(model, ids, f, a.context))
    comp = compounding(model, ids, a.context)
    cmd = "python -m bench.kv_format " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"Command: `{cmd.strip()}`. {machine_line()}. Weights {a.weights}.\n")
    print(f"| working set | bytes at {a.context} tokens | perplexity ({a.windows} x {a.width}) | "
          f"decode at {a.context}, ms/token (median of {a.rounds}) |\n|---|---:|---:|---:|")
    for f in fmts:
        print(f"| {f} | {nbytes[f] / 2**20:.1f} MiB ({nbytes[f] / nbytes['float']:.1%}) | {ppl[f]:.3f} "
              f"({ppl[f] / ppl['float'] - 1:+.2%}) | {statistics.median(ms[f]):.1f} |")
    print("\n| K/V | keys, relative RMS error | values |\n|---|---:|---:|")
    for name, (k, v) in comp.items():
        print(f"| {name} | {k:.4f} | {v:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
