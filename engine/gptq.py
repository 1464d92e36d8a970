"""Calibrated int4 weights: GPTQ (Frantar et al., "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers", 2022) for the `-gptq` formats (`int4-g128-gptq`, ...).

This module deliberately knows nothing about files or the cache: engine.weightcache asks it for the
layers' int4 matrices once, at conversion, and writes them.

Rounding every weight to its nearest int4 step (engine.quant.quantize_int4) ignores which inputs a
matrix sees. GPTQ quantizes a matrix one input column at a time and spreads each column's rounding
error over the columns not yet quantized, weighted by the inverse of `H = X^T X`, the Gram matrix of
the inputs the matrix receives on calibration text, so that the layer's outputs, not its weights,
stay close. Here: columns in the order of decreasing `diag(H)` ("act order"); each group's scale
and minimum fixed beforehand from the float weights ("static groups", so the stored layout stays
group-contiguous) by engine.quant's clipped-range search with each input's error weighed by its
`diag(H)` (unweighted, the default model at group 128 ended at +10.8% perplexity instead of +6.9%);
a damping of 1% of the mean diagonal; and layer by layer ("sequential"): the inputs of layer `l`
are computed through the already quantized layers before it (matrix by matrix within a layer came
out no better). The calibration text is the docstrings of some standard-library modules, which ship
with Python (nothing is downloaded) and are not the benchmark suite's held-out text (the reference
manual's topics). On the default model at group 128 this takes the perplexity of the held-out text
from +41% (rounding) to +6.9% (docs/benchmarks.md, "Quantized weights").
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import numpy as np
import torch

from engine import quant

CALIBRATION_MODULES = (
    "json", "argparse", "collections", "logging", "asyncio", "email", "http.client", "unittest", "csv", "sqlite3",
    "subprocess", "threading", "pathlib", "datetime", "decimal", "fractions", "statistics", "random", "heapq",
    "bisect", "shutil", "tempfile", "zipfile", "tarfile", "gzip", "hashlib", "hmac", "secrets", "string", "textwrap",
    "difflib", "pprint")
"""Standard-library modules whose docstrings are the calibration text."""
CALIBRATION_SEQS = 16
CALIBRATION_TOKENS = 512
"""Sequences and tokens each: 8,192 tokens (half as many left the default model at +12% at group 128)."""
CALIBRATION_VERSION = "gptq-2"
"""Recorded in a calibrated cache file; a file of another version is converted again (2: group ranges
searched with the inputs' second moments as weights)."""
DAMP = 0.01
"""Added to `H`'s diagonal, as a fraction of its mean."""
MATRICES = ("wqkv", "wo", "w_gate_up", "w_down")
"""A layer's matrices, by their engine names."""


def calibration_text() -> str:
    """The docstrings (200 characters or more) of the members of `CALIBRATION_MODULES`, each once."""
    texts = []
    for name in CALIBRATION_MODULES:
        module = importlib.import_module(name)
        for _, obj in inspect.getmembers(module):
            doc = inspect.getdoc(obj)
            if doc and len(doc) >= 200:
                texts.append(doc)
    return "\n\n".join(dict.fromkeys(texts))


def gptq_int4(w: torch.Tensor, h: torch.Tensor, group: int, damp: float = DAMP, block: int = 128
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int4 triple (engine.quant's layout) of float `w` `[n, k]` for inputs whose Gram matrix is
    `h` `[k, k]`."""
    w = w.detach().to(torch.float32).clone()
    k = w.shape[1]
    # each group's range, from the float weights, errors weighed by how much each input moves
    _, scale16, lo16 = quant.quantize_int4(w.numpy(), group, importance=torch.diag(h).to(torch.float32).numpy())
    scale, lo = torch.from_numpy(scale16.astype(np.float32)), torch.from_numpy(lo16.astype(np.float32))
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    h = h.to(torch.float64).clone()
    dead = torch.diag(h) == 0  # inputs that never moved: their weights do not matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    order = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, order], h[order][:, order]
    groups = order // group
    h += damp * torch.mean(torch.diag(h)) * torch.eye(k, dtype=h.dtype)
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)
    q = torch.empty(w.shape, dtype=torch.uint8)
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, err1, hi = w[:, i1:i2].clone(), torch.empty(w.shape[0], i2 - i1), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            g = groups[i1 + i]
            col = w1[:, i]
            qi = torch.clamp(torch.round((col - lo[:, g]) / safe[:, g]), 0, 15)
            q[:, i1 + i] = qi.to(torch.uint8)
            e = (col - (qi * scale[:, g] + lo[:, g])) / hi[i, i]
            w1[:, i:] -= e.unsqueeze(1) * hi[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(order)].numpy()
    return quant.pack_nibbles(q), scale16, lo16


def calibrated_int4(directory: str | Path, fingerprint: str | None, group: int, *, progress: bool = False
                    ) -> dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """`layers.{i}.{matrix}` -> int4 triple for every layer matrix of the checkpoint in `directory`,
    by GPTQ over its float weights (the fp32 layout, mapped from the model cache)."""
    from engine.chat import ChatTokenizer
    from engine.config import EngineConfig
    from engine.model import Transformer

    model = Transformer.from_directory(directory, EngineConfig(device="cpu", weights="fp32", native_attention=False),
                                       fingerprint=fingerprint)
    try:
        tok = ChatTokenizer(directory)
    except Exception as e:  # noqa: BLE001 - any failure to read it means the same thing here
        raise quant.WeightFormatError(f"calibrated (-gptq) formats need the model's tokenizer: {e}") from None
    ids = tok.encode_document(calibration_text())
    n = CALIBRATION_TOKENS
    seqs = [ids[i * n : (i + 1) * n] for i in range(min(CALIBRATION_SEQS, len(ids) // n))]
    if not seqs:
        raise quant.WeightFormatError("not enough calibration text for the -gptq formats")
    out: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
    with torch.inference_mode():
        xs = [model.w.embed(torch.tensor(s)) for s in seqs]
        pos = torch.arange(n)
        for layer, lw in enumerate(model.w.layers):
            grams = _record_inputs(lw)
            for x in xs:
                model._layer(layer, x.clone(), pos, model.new_cache(n), contiguous=True, density=None, sdpa=False)
            for name in MATRICES:
                lin = grams.restore(name)
                triple = gptq_int4(lin.weight, grams.h[name], group)
                out[f"layers.{layer}.{name}"] = triple
                lin.weight = torch.from_numpy(quant.dequantize_int4(*triple, group))  # the next layers see it
            for j, x in enumerate(xs):
                xs[j] = model._layer(layer, x, pos, model.new_cache(n), contiguous=True, density=None, sdpa=False)
            if progress and sys.stderr.isatty():
                print(f"\rllmaas: calibrated {layer + 1}/{len(model.w.layers)} layers", end="", file=sys.stderr,
                      flush=True)
    if progress and sys.stderr.isatty():
        print(file=sys.stderr)
    return out


class _record_inputs:
    """Swap a layer's matrices for recorders that add their inputs' Gram matrix into `h[name]`."""

    def __init__(self, lw) -> None:
        self.lw, self.h, self.orig = lw, {}, {}
        for name in MATRICES:
            lin = getattr(lw, name)
            self.orig[name] = lin
            setattr(lw, name, _Recorder(lin, self.h, name))

    def restore(self, name: str):
        setattr(self.lw, name, self.orig[name])
        return self.orig[name]


class _Recorder:
    def __init__(self, lin, h: dict, name: str) -> None:
        self.lin, self.h, self.name = lin, h, name

    def _add(self, x: torch.Tensor) -> None:
        x2 = x.reshape(-1, x.shape[-1]).to(torch.float64)
        self.h[self.name] = self.h.get(self.name, 0) + x2.T @ x2

    def __call__(self, x):
        self._add(x)
        return self.lin(x)

    def add_into(self, out, x):
        self._add(x)
        return self.lin.add_into(out, x)
