"""Memory of a prefill before it runs (HyperGen §3.2, Table 1), and how to partition one that does not
fit a budget.

This module deliberately knows nothing about tensors, the model's code, devices or files: it is
arithmetic over shapes, the caller measures and executes.

**Estimate.** HyperGen's Table 1 gives, for each step of a transformer block's prefill, the bytes
held at its peak and retained after it, from the prompt length ``s`` and the model's widths. Here it
is generalised to this engine's block (engine/model.py): grouped-query attention (``Hq`` query heads
sharing ``Hkv`` K/V heads of width ``D``), RMSNorm, rotary embedding, SwiGLU's fused gate and up
projection (``2 I`` wide), attention computed blockwise over ``b`` query rows at a time (never an
``n x S`` score matrix), K/V written into the context's working set in its stored format. A block
runs ``p`` new rows against ``S = c + p`` keys (``c`` tokens already in the context) in three steps,
each one's tensors in the compute dtype (``a`` bytes):

=========  ==========================================================================================
step       alive at its peak (beside the hidden state ``x`` of the rows, ``a p H``)
=========  ==========================================================================================
qkv        the normed rows ``h`` (``a p H``), the fused Q/K/V product (``a p (Hq + 2 Hkv) D``), the
           rotary tables of the rows (``a p 1.5 D``), the rotated Q/K (``a p (Hq + Hkv) D``); a
           quantized weight is de-quantized for the product of more than 8 rows (``w_qkv``, freed
           before the rotation); packing into a ``kv8`` working set takes ``8 Hkv p D``
attention  what qkv retains, plus the scaled and regrouped queries and the output (``2 a p Hq D``),
           one block's scores and probabilities (``(a + 4) b Hq S``, probabilities in float32), the
           density's column sums (``4 Hkv S``), the output regrouped (``a p Hq D``); over a ``kv8``
           working set one layer's keys and values de-quantized (``2 a Hkv S D``)
mlp        what attention retains (``h`` renewed), plus the gate and up product (``2 a p I``),
           a de-quantized weight as above (``w_mlp``)
=========  ==========================================================================================

and after ``mlp`` only ``x`` stays. The compiled attention kernel (engine/attention.c) holds its own
scratch instead of the torch kernel's scores (for many rows the keys transposed, ``4 Hkv D S``, and
a tile of 48 rows of scores a thread; for few rows a row of scores a thread), allocated with
``malloc`` where no tensor tracker sees it; :attr:`PrefillShape.native_attention` counts that
instead, from the kernel's own sizes. K/V of the context is
counted apart (:func:`kv_bytes`): all layers when they stay in the budget, one layer when each
finished layer leaves it (``severe`` below).

**Plan.** :func:`plan_prefill` picks the lightest of HyperGen's three cases that fits a budget:

- ``none``: all ``n`` new rows in one pass, every layer's K/V resident;
- ``moderate``: the rows in partitions of ``p`` (each partition runs a whole block before the next,
  which is exact under the causal mask: a partition attends only to rows written before it), every
  layer's K/V resident;
- ``severe``: partitions as ``moderate``, layer by layer over all rows, each finished layer's K/V
  moved out of the budget as it is produced, and the hidden state of all rows spilled out of the
  budget when it does not fit beside the rest. In the budget: two layers' K/V of the context (the
  layer computing and the one being written out while it does) and the cached tokens' K/V of the
  next layer (read ahead); with the hidden state spilled, a partition's rows besides the one
  computing (being written out). Decoding the context afterwards holds three layers (computing, read
  ahead, written out) and a row's steps. As many more layers as fit beside the higher of the two
  stay resident (:attr:`PrefillPlan.resident_layers`);
- ``refuse``: not even ``severe`` with the smallest partition fits: a caller answers 413 with the
  estimate before doing any work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from scheduler.keys import count

PLAN_KINDS = ("none", "moderate", "severe", "refuse")
MIN_PARTITION_ROWS = 16
"""The smallest partition ``plan_prefill`` tries for ``moderate``: one chunk of a context."""
FEW_ROWS = 8
"""The partition ``severe`` tries last: fewer rows than :data:`NATIVE_MIN_ROWS`, so the compiled kernel
takes its row path, which holds no transposed copy of the keys (a prefill onto a long context)."""
SCORE_BUDGET_BYTES = 9 << 19
"""engine/attention.py's bytes of scores per attention block (it sizes ``b`` from them)."""
MAX_BLOCK_ROWS = 64
"""engine/attention.py's most query rows per attention block."""
NATIVE_MIN_ROWS = 16
"""engine/attention.py's fewest rows the compiled kernel runs as `attn_forward` (fewer: `attn_rows`). These
three mirror the engine's (this module imports no model); tests/engine/test_memtrack.py checks them."""


@dataclass(frozen=True, slots=True)
class PrefillShape:
    """What the estimate needs of a model and its working set (all sizes in elements or bytes)."""

    hidden: int
    """Residual width ``H``."""
    intermediate: int
    """SwiGLU inner width ``I``."""
    n_layers: int
    n_heads: int
    """Query heads ``Hq``."""
    n_kv_heads: int
    """K/V heads ``Hkv``."""
    head_dim: int
    """``D``."""
    act_bytes: int = 4
    """Bytes of the compute dtype ``a`` (float32 4, bfloat16 2)."""
    kv_row_bytes: int = 0
    """Bytes of one token's K/V in one layer as the working set holds it; 0: ``2 Hkv D a``."""
    qkv_weight_bytes: int = 0
    """Bytes of the fused Q/K/V weight de-quantized for a product of many rows (0 for float weights)."""
    mlp_weight_bytes: int = 0
    """The same for the largest MLP weight (gate and up fused, or down)."""
    bf16_products: bool = False
    """Those products run in bfloat16 (engine/qlinear.py, `EngineConfig.quantized_prefill_bf16`): the
    weight de-quantized to bfloat16, the rows cast to it, the result cast back to the compute dtype."""
    native_attention: bool = False
    """Attention runs in engine/attention.c (its scratch instead of the torch kernel's scores)."""
    kv8: bool = False
    """The working set is ``kv8``: attention de-quantizes one layer's K/V for many rows."""
    threads: int = 2
    """Threads of the compiled kernel (each holds a tile of scores)."""

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "n_layers", "n_heads", "n_kv_heads", "head_dim", "act_bytes"):
            count(name, getattr(self, name), 1)

    @property
    def qkv_width(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim

    @property
    def row_kv_bytes(self) -> int:
        """``kv_row_bytes`` in effect."""
        return self.kv_row_bytes or 2 * self.n_kv_heads * self.head_dim * self.act_bytes


@dataclass(frozen=True, slots=True)
class StepEstimate:
    """One step of one block, in bytes (K/V of the context not included)."""

    name: str
    """``qkv``, ``attention`` or ``mlp``."""
    peak: int
    """Held at the step's highest point."""
    retained: int
    """Held after it (the next step's starting point)."""


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """How a prefill of ``new`` rows onto ``cached`` tokens runs within ``budget`` bytes."""

    kind: str
    """One of :data:`PLAN_KINDS`."""
    new: int
    """Rows (tokens) the prefill adds."""
    cached: int
    """Tokens of the context before it."""
    partition_rows: int
    """Rows a block runs at once (``new`` when ``none``)."""
    spill_hidden: bool
    """The hidden state of all rows lives outside the budget between blocks (``severe`` only)."""
    peak: int
    """Estimated bytes at the highest step, K/V in the budget included (the smallest partition's for
    ``refuse``)."""
    budget: int
    """What it had to fit in."""
    resident_layers: int = 0
    """Layers whose K/V stays in the budget; the others are streamed (fewer than all only when
    ``severe``)."""
    decode_bound: bool = False
    """``refuse`` only: decoding after the prefill (three streamed layers' K/V) is what does not fit."""

    @property
    def partitions(self) -> int:
        return math.ceil(self.new / self.partition_rows) if self.partition_rows else 0

    def describe(self) -> str:
        """A one-line account for an error message or a log."""
        mib = 1 << 20
        if self.kind == "refuse":
            how = ("to decode after it with three layers' K/V in memory" if self.decode_bound else
                   f"partitioned by {self.partition_rows} rows, hidden state spilled")
            return (f"a prefill of {self.new} tokens onto {self.cached} needs at least {self.peak / mib:.1f} MiB "
                    f"({how}), over the budget of {self.budget / mib:.1f} MiB")
        resident = f", K/V of {self.resident_layers} layer(s) resident" if self.kind == "severe" else ""
        return (f"{self.kind}: {self.partitions} partition(s) of {self.partition_rows} rows"
                f"{', hidden state spilled' if self.spill_hidden else ''}{resident}; estimated peak "
                f"{self.peak / mib:.1f} MiB of {self.budget / mib:.1f} MiB")


def block_rows(shape: PrefillShape, rows: int, keys: int) -> int:
    """Query rows per attention block, as engine/attention.py `attend_blockwise` sizes them."""
    b = max(16, min(MAX_BLOCK_ROWS, SCORE_BUDGET_BYTES // (4 * shape.n_heads * keys)))
    b = -(-rows // -(-rows // b))  # equal blocks
    return min(rows, b)


def estimate_steps(shape: PrefillShape, rows: int, cached: int) -> list[StepEstimate]:
    """The three steps of one block run on ``rows`` new rows against ``cached + rows`` keys."""
    p, s = count("rows", rows, 1), count("cached", cached) + rows
    a, hq, hkv, d = shape.act_bytes, shape.n_heads, shape.n_kv_heads, shape.head_dim
    x = a * p * shape.hidden
    h = a * p * shape.hidden
    qkv = a * p * shape.qkv_width
    rope = a * p * d * 3 // 2
    qk = a * p * (hq + hkv) * d
    retained_qkv = x + h + qkv + rope + qk
    many = p > 8  # products of more rows de-quantize a quantized weight (engine/qlinear.py)
    bf16 = many and shape.bf16_products  # then the weight, the rows and the result also in bfloat16
    qkv_product = (max(2 * shape.qkv_width * shape.hidden + 2 * p * (shape.hidden + shape.qkv_width),
                       2 * p * shape.qkv_width + qkv) if bf16 else qkv + (shape.qkv_weight_bytes if many else 0))
    peak_qkv = max(retained_qkv, x + h + qkv_product)  # freed before rope
    if shape.kv8:  # packing the new rows: two float32 temporaries of the keys' (or values') size
        peak_qkv = max(peak_qkv, retained_qkv + 8 * hkv * p * d)
    out = a * p * hq * d
    t = shape.threads
    if shape.native_attention and p >= NATIVE_MIN_ROWS:  # attn_forward: keys transposed, tiles a thread
        transient = out + 4 * (hkv * d * s + t * s + t * (48 * s + 96 * d))
        if shape.kv8:
            transient += 2 * a * hkv * s * d
    elif shape.native_attention:  # attn_rows (attn_rows_kv8): a row of scores a thread, or a group's
        g = hq // hkv
        transient = out + 4 * t * ((g + 1) * s + (256 + g) * d if shape.kv8 else 2 * s)
    else:  # the torch kernel, blocks of b rows
        b = block_rows(shape, p, s)
        transient = 2 * out + (a + 4) * b * hq * s + 4 * hkv * s + out
        if shape.kv8:
            transient += 2 * a * hkv * s * d
    peak_attention = retained_qkv + transient
    retained_attention = retained_qkv + out
    gate_up = 2 * a * p * shape.intermediate
    peak_mlp = retained_attention + gate_up + (shape.mlp_weight_bytes if many else 0)
    if bf16:  # bfloat16 weight, rows and result of the gate/up product; then of the down product beside gate_up
        i, hd = shape.intermediate, shape.hidden
        peak_mlp = retained_attention + max(4 * i * hd + 2 * p * (hd + 2 * i), 2 * p * 2 * i + gate_up,
                                            gate_up + 2 * i * hd + 2 * p * (i + hd))
    return [StepEstimate("qkv", peak_qkv, retained_qkv),
            StepEstimate("attention", peak_attention, retained_attention),
            StepEstimate("mlp", peak_mlp, x)]


def kv_bytes(shape: PrefillShape, tokens: int, layers: int | None = None) -> int:
    """K/V of ``tokens`` tokens over ``layers`` layers (all by default) as the working set holds it."""
    return count("tokens", tokens) * shape.row_kv_bytes * (shape.n_layers if layers is None else layers)


def peak_bytes(shape: PrefillShape, new: int, cached: int, rows: int, *, severe: bool, spill: bool) -> int:
    """Highest estimated bytes of a prefill run in partitions of ``rows``: the last partition's steps
    (it sees the most keys) beside the hidden state of the rows not in it (spilled: of the partition
    being written out) and the K/V in the budget (``severe``: the streaming window's layers)."""
    rows = min(rows, new)
    steps = estimate_steps(shape, rows, cached + new - rows)
    rest = shape.act_bytes * shape.hidden * (min(rows, new - rows) if spill else new - rows)
    if severe:
        kv = kv_bytes(shape, cached + new, min(2, shape.n_layers)) + kv_bytes(shape, cached, 1)
    else:
        kv = kv_bytes(shape, cached + new)
    return max(st.peak for st in steps) + rest + kv


def streamed_decode_bytes(shape: PrefillShape, tokens: int) -> int:
    """A decode step over ``tokens`` tokens whose layers stream: a row's steps beside three layers' K/V
    (the layer computing, the next read ahead, the last written out)."""
    row = max(st.peak for st in estimate_steps(shape, 1, max(0, tokens - 1)))
    return row + kv_bytes(shape, tokens, min(3, shape.n_layers))


def plan_prefill(shape: PrefillShape, new: int, cached: int, budget: int) -> PrefillPlan:
    """The lightest plan whose estimated peak fits ``budget`` bytes (see the module docstring)."""
    new, cached, budget = count("new", new, 1), count("cached", cached), count("budget", budget)
    layers = shape.n_layers
    peak = peak_bytes(shape, new, cached, new, severe=False, spill=False)
    if peak <= budget:
        return PrefillPlan("none", new, cached, new, False, peak, budget, layers)
    sizes = [r for r in _partition_sizes(new) if r < new]
    for r in sizes:
        peak = peak_bytes(shape, new, cached, r, severe=False, spill=False)
        if peak <= budget:
            return PrefillPlan("moderate", new, cached, r, False, peak, budget, layers)
    per_layer = kv_bytes(shape, cached + new, 1)
    decode = streamed_decode_bytes(shape, cached + new)
    few = [FEW_ROWS] if new > FEW_ROWS else []  # the compiled kernel's row path copies no keys
    for r in (sizes or [new]) + few:  # larger partitions first: small ones run far slower than a spill
        for spill in (False, True):
            peak = max(decode, peak_bytes(shape, new, cached, r, severe=True, spill=spill))
            if peak <= budget:
                resident = min(layers - 1, (budget - peak) // per_layer)
                return PrefillPlan("severe", new, cached, r, spill, peak + resident * per_layer, budget, resident)
    smallest = min(FEW_ROWS, new)
    least = peak_bytes(shape, new, cached, smallest, severe=True, spill=True)
    return PrefillPlan("refuse", new, cached, smallest, True, max(decode, least), budget, decode_bound=decode > least)


def _partition_sizes(new: int) -> list[int]:
    """Candidate rows per partition, largest first: ``new`` halved (rounded up to whole 16-token
    chunks) down to :data:`MIN_PARTITION_ROWS`."""
    out, r = [], new
    while True:
        r = max(MIN_PARTITION_ROWS, -(-r // 2 // MIN_PARTITION_ROWS) * MIN_PARTITION_ROWS)
        if out and r >= out[-1]:
            break
        out.append(r)
        if r == MIN_PARTITION_ROWS:
            break
    return out
