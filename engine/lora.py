"""LoRA adapters in the PEFT format, applied beside the base weights without merging (MNN-LLM §5.5).

This module deliberately knows nothing about Ray or the service: `load_adapter` reads and checks a
directory against a model's shapes; `AdapterSet` holds the adapters one node has loaded, by name;
`merged` folds an adapter into a float model's weights (a new model, with its own fingerprint).

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as
`peft.PeftModel.save_pretrained` writes them. Each adapted projection adds `s · B (A x)` to the base
product, computed in that order (MNN-LLM Table 3: `A x` first is `r (k + n)` multiply-adds a row
against `k n` for a merged `B A`), with `s = alpha / r` (`alpha / sqrt(r)` under rsLoRA). The engine
fuses q/k/v and gate/up into one product each, so one `LayerDelta` serves a fused product: the `A`s
of its projections stacked into one `[R, k]` matrix (one GEMM for all of them) and each `B` added
into its rows of the output.

Every refusal is an `AdapterError` with a stable `code` and changes nothing already loaded:
`adapter_not_found` (no such directory, or a file missing), `adapter_outside_root` (a path or a
symlink leading out of the adapter root), `bad_adapter` (unreadable files, another PEFT type, rank 0,
shapes that do not fit the model, NaN or infinite values, an unknown target module or tensor),
`adapter_exists`, `unknown_adapter`, `adapter_unavailable` (a context's adapter is not loaded, or its
files changed), `adapter_merge_quantized`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import ModelConfig
from engine.loader import read_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MODULES = {  # PEFT target module -> (engine tensor, part of the fused output in order)
    "q_proj": ("wqkv", 0), "k_proj": ("wqkv", 1), "v_proj": ("wqkv", 2), "o_proj": ("wo", 0),
    "gate_proj": ("w_gate_up", 0), "up_proj": ("w_gate_up", 1), "down_proj": ("w_down", 0),
}
_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[A-Za-z_]\w*)?\.weight$")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class AdapterError(ValueError):
    """An adapter refused; `code` is stable (the HTTP layer maps it to a status)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self):  # pickled whole (Ray hands it from actor to caller), code included
        return (type(self), (self.code, str(self)))


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (out, in) features of the base projection."""
    d, h, i = cfg.head_dim, cfg.hidden_size, cfg.intermediate_size
    return {"q_proj": (cfg.n_heads * d, h), "k_proj": (cfg.n_kv_heads * d, h), "v_proj": (cfg.n_kv_heads * d, h),
            "o_proj": (h, cfg.n_heads * d), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


@dataclass(slots=True)
class LayerDelta:
    """The adapter's part of one fused product of one layer: `y[:, rows] += (x A^T)[:, ranks] B^T`."""

    a: torch.Tensor
    """`[R, k]`: the `A`s of the adapted projections, stacked."""
    parts: list[tuple[int, int, int, int, torch.Tensor]]
    """(first output row, end row, first rank, end rank, `s · B` `[rows, ranks]`) per projection."""

    def add_into(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`y += delta(x)` in place, `x` `[m, k]`, `y` `[m, n]` (the base product's output)."""
        t = F.linear(x.to(self.a.dtype), self.a)  # [m, R]: the cheap order, A x first
        for r0, r1, k0, k1, b in self.parts:
            y[:, r0:r1].addmm_(t[:, k0:k1].to(y.dtype), b.t().to(y.dtype))
        return y


@dataclass(slots=True)
class Adapter:
    """One loaded adapter."""

    name: str
    """What callers select it by (the OpenAI `model` field, a context's binding)."""
    key: str
    """`name@digest`: the K/V key's adapter part (actors.messages.KVKey.adapter). The digest covers
    the files' bytes, so an adapter replaced under the same name never reads the old one's K/V."""
    path: str
    """Its directory, relative to the adapter root."""
    rank: int
    """Largest rank of its projections."""
    targets: tuple[str, ...]
    """PEFT module names it adapts."""
    layers: list[dict[str, LayerDelta]] = field(repr=False)
    """Per layer: engine tensor name (`wqkv`, `wo`, `w_gate_up`, `w_down`) -> its delta."""

    def delta(self, layer: int, tensor: str) -> LayerDelta | None:
        return self.layers[layer].get(tensor)

    def nbytes(self) -> int:
        return sum(d.a.numel() * d.a.element_size() + sum(p[4].numel() * p[4].element_size() for p in d.parts)
                   for layer in self.layers for d in layer.values())


def resolve_under(root: str | Path, path: str | Path) -> Path:
    """`path` (relative to `root`, or absolute inside it) with every symlink followed; refuses one that
    leads out of the root."""
    base = Path(os.path.realpath(root))
    p = Path(path)
    full = Path(os.path.realpath(p if p.is_absolute() else base / p))
    if full != base and base not in full.parents:
        raise AdapterError("adapter_outside_root", f"adapter path {str(path)!r} leads outside the adapter root {str(base)!r}")
    return full


def _targets(config: dict) -> set[str] | re.Pattern:
    t = config.get("target_modules")
    if isinstance(t, str):
        return re.compile(t)
    if not isinstance(t, list) or not t:
        raise AdapterError("bad_adapter", f"target_modules must be a non-empty list or a pattern, not {t!r}")
    unknown = sorted(set(t) - set(MODULES))
    if unknown:
        raise AdapterError("bad_adapter", f"unknown target module(s) {unknown}; this engine adapts {sorted(MODULES)}")
    return set(t)


def _tensor(a: np.ndarray) -> torch.Tensor:
    """A float32 copy of a mapped safetensors array (bfloat16 arrive as their uint16 bits)."""
    if a.dtype == np.uint16:
        return torch.from_numpy(a.copy()).view(torch.bfloat16).float()
    return torch.from_numpy(np.array(a, dtype=np.float32) if a.dtype.kind == "f" else np.array(a))


def _read_config(directory: Path) -> dict:
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError("bad_adapter", f"{CONFIG_FILE}: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError("bad_adapter", f"{CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError("bad_adapter", f"peft_type {config.get('peft_type')!r}: only LORA adapters load")
    for key, ok in (("use_dora", False), ("fan_in_fan_out", False)):
        if bool(config.get(key, False)) != ok:
            raise AdapterError("bad_adapter", f"{key}={config.get(key)!r} is not supported")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise AdapterError("bad_adapter", "adapters that train biases or save whole modules are not supported")
    if not isinstance(config.get("r", 8), int) or config.get("r", 8) < 1:
        raise AdapterError("bad_adapter", f"rank r={config.get('r')!r}: it must be a positive integer")
    return config


def _alpha(config: dict, module: str, layer: int) -> float:
    """lora_alpha, or an alpha_pattern entry whose key matches the module's name."""
    name = f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    for key, value in (config.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", name):
            return float(value)
    return float(config.get("lora_alpha", 8))


def load_adapter(root: str | Path, path: str | Path, cfg: ModelConfig, *, name: str, device="cpu",
                 dtype=torch.float32) -> Adapter:
    """Read and check the adapter at `path` under `root` against a model of `cfg`."""
    if not _NAME.fullmatch(name or ""):
        raise AdapterError("bad_adapter", f"adapter name {name!r}: 1-64 letters, digits, '.', '_' or '-'")
    directory = resolve_under(root, path)
    files = [directory / CONFIG_FILE, directory / WEIGHTS_FILE]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise AdapterError("adapter_not_found", f"no adapter at {str(path)!r}: {', '.join(missing)} missing")
    for f in files:
        resolve_under(root, f)  # a file symlinked out of the root is refused too
    config = _read_config(directory)
    targets = _targets(config)
    try:
        tensors = {k: _tensor(a) for k, a in read_safetensors(directory, WEIGHTS_FILE).items()}
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise AdapterError("bad_adapter", f"{WEIGHTS_FILE}: {e}") from None
    digest = hashlib.sha256(files[0].read_bytes() + files[1].read_bytes()).hexdigest()[:16]
    shapes = module_shapes(cfg)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _TENSOR.search(key)
        if m is None:
            raise AdapterError("bad_adapter", f"tensor {key!r} is not a LoRA A or B matrix of a decoder layer")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise AdapterError("bad_adapter", f"tensor {key!r} adapts unknown module {module!r}")
        if isinstance(targets, set) and module not in targets:
            raise AdapterError("bad_adapter", f"tensor {key!r} adapts {module!r}, not among target_modules")
        if layer >= cfg.n_layers:
            raise AdapterError("bad_adapter", f"tensor {key!r}: layer {layer} of a {cfg.n_layers}-layer model")
        if not t.dtype.is_floating_point or not torch.isfinite(t).all():
            raise AdapterError("bad_adapter", f"tensor {key!r} holds NaN, infinite or non-float values")
        pairs.setdefault((layer, module), {})[ab] = t
    if not pairs:
        raise AdapterError("bad_adapter", "the adapter holds no LoRA matrices")
    per_layer: list[dict[str, list]] = [{} for _ in range(cfg.n_layers)]
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise AdapterError("bad_adapter", f"layer {layer} {module}: lora_A and lora_B must both be present")
        a, b = ab["A"], ab["B"]
        out_f, in_f = shapes[module]
        r = a.shape[0] if a.dim() == 2 else 0
        if r < 1 or a.shape != (r, in_f) or b.shape != (out_f, r):
            raise AdapterError("bad_adapter", f"layer {layer} {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do "
                               f"not fit a [{out_f}, {in_f}] projection at a rank of at least 1")
        alpha = _alpha(config, module, layer)
        scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        rank = max(rank, r)
        tensor, part = MODULES[module]
        per_layer[layer].setdefault(tensor, []).append((part, a.float(), b.float() * scale))
    layers = []
    for layer, found in enumerate(per_layer):
        deltas = {}
        for tensor, items in found.items():
            items.sort(key=lambda x: x[0])
            widths = [shapes[m][0] for m, (t, _p) in MODULES.items() if t == tensor]  # fused parts' rows, in order
            parts, k0 = [], 0
            for part, a, b in items:
                r0 = sum(widths[:part])
                parts.append((r0, r0 + widths[part], k0, k0 + a.shape[0], b.to(device=device, dtype=dtype)))
                k0 += a.shape[0]
            stacked = torch.cat([a for _p, a, _b in items]).to(device=device, dtype=dtype)
            deltas[tensor] = LayerDelta(stacked, parts)
        layers.append(deltas)
    rel = os.path.relpath(directory, os.path.realpath(root))
    return Adapter(name=name, key=f"{name}@{digest}", path=rel, rank=rank,
                   targets=tuple(sorted({m for _l, m in pairs})), layers=layers)


class AdapterSet:
    """The adapters loaded on one node, by name, for one model; loading is all or nothing."""

    def __init__(self, root: str | Path | None, cfg: ModelConfig, *, device="cpu", dtype=torch.float32) -> None:
        self.root = Path(root) if root else None
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self._by_name: dict[str, Adapter] = {}

    def add(self, name: str, path: str | Path) -> Adapter:
        if self.root is None:
            raise AdapterError("bad_adapter", "no adapter root is configured (adapter_root / --adapter-root)")
        if name in self._by_name:
            raise AdapterError("adapter_exists", f"adapter {name!r} is already loaded")
        adapter = load_adapter(self.root, path, self.cfg, name=name, device=self.device, dtype=self.dtype)
        self._by_name[name] = adapter
        return adapter

    def get(self, name: str) -> Adapter:
        try:
            return self._by_name[name]
        except KeyError:
            raise AdapterError("unknown_adapter", f"no adapter named {name!r} is loaded") from None

    def by_key(self, key: str) -> Adapter | None:
        """The adapter a context's K/V is keyed by ("" for the base model: None). A key not loaded
        (removed, or its files changed since the context was made) is `adapter_unavailable`: the
        context's K/V must not be extended under other weights."""
        if not key:
            return None
        a = self._by_name.get(key.partition("@")[0])
        if a is None or a.key != key:
            now = f"now {a.key}" if a is not None else "not loaded"
            raise AdapterError("adapter_unavailable", f"the context is computed under adapter {key}, {now}")
        return a

    def resolve(self, name: str, path: str, key: str) -> Adapter:
        """The adapter `key`, loaded from `path` if this process has not loaded it yet (a second
        process of the node following the first one's registry); `adapter_unavailable` when the
        files there are no longer the ones `key` names."""
        a = self._by_name.get(name)
        if a is None or a.key != key:
            if self.root is None:
                raise AdapterError("adapter_unavailable", f"adapter {key}: no adapter root is configured")
            a = load_adapter(self.root, path, self.cfg, name=name, device=self.device, dtype=self.dtype)
            if a.key != key:
                raise AdapterError("adapter_unavailable", f"adapter {name!r} at {path!r} is now {a.key}, not {key}")
            self._by_name[name] = a
        return a

    def remove(self, name: str) -> None:
        self.get(name)
        del self._by_name[name]

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def __contains__(self, name: str) -> bool:
        return name in self._by_name


def merged(model, adapter: Adapter):
    """A new float model with `adapter` folded into copies of its weights (`W + s B A`), fingerprinted
    as `{base fingerprint}+{adapter.key}`; quantized weights are refused (merging would re-quantize)."""
    from engine.model import LayerWeights, Transformer, Weights
    from engine.qlinear import FloatLinear

    if not all(isinstance(getattr(w, t), FloatLinear) for w in model.w.layers
               for t in ("wqkv", "wo", "w_gate_up", "w_down")):
        raise AdapterError("adapter_merge_quantized", f"merging needs float weights, not {model.weight_format}")
    layers = []
    for i, w in enumerate(model.w.layers):
        new = {}
        for t in ("wqkv", "wo", "w_gate_up", "w_down"):
            lin, d = getattr(w, t), adapter.delta(i, t)
            if d is None:
                new[t] = lin
                continue
            weight = lin.weight.clone()
            for r0, r1, k0, k1, b in d.parts:
                weight[r0:r1] += (b.float() @ d.a[k0:k1].float()).to(weight.dtype)
            new[t] = FloatLinear(weight, lin.bias)
        layers.append(LayerWeights(attn_norm=w.attn_norm, mlp_norm=w.mlp_norm, **new))
    out = Transformer(model.cfg, Weights(model.w.embed, layers, model.w.norm, model.w.lm_head), model.engine_cfg)
    out.fingerprint = f"{model.fingerprint}+{adapter.key}"
    return out


__all__ = ["Adapter", "AdapterError", "AdapterSet", "LayerDelta", "load_adapter", "merged", "module_shapes",
           "resolve_under"]
