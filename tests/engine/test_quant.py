"""Weight formats (engine.quant, engine.qlinear, engine.weightcache): stored values, the compiled
products against float references, the GGUF repack, conversion memory, embeddings left on flash, and
perplexity bounds of the default model in each format against float32 on real text."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from engine import quant
from engine.qlinear import Int4Linear, Int8Linear, kernels
from engine.quant import WeightFormat, WeightFormatError


def test_weight_format_names_round_trip_and_refuse_nonsense():
    for text, tag in [("fp32", "fp32"), ("BF16", "bf16"), ("int8", "int8"), ("int4", "int4-g32"),
                      ("int4-g128", "int4-g128"), ("int4-g64-hfp32", "int4-g64-hfp32"), ("int8-hfp32", "int8-hfp32"),
                      ("int4-g128-gptq", "int4-g128-gptq"), ("int4-gptq-hfp32", "int4-g32-hfp32-gptq")]:
        fmt = WeightFormat.parse(text)
        assert fmt.tag == tag and WeightFormat.parse(fmt.tag) == fmt
    for bad in ["int3", "int4-g48", "int4-g0", "fp32-g32", "int4-hq2", "int4-x", "", "int8-gptq", "bf16-gptq"]:
        with pytest.raises(WeightFormatError) as e:
            WeightFormat.parse(bad)
        assert e.value.code == "bad_weight_format"


def test_nibble_layout_is_ggufs_block_layout():
    q = np.arange(64, dtype=np.uint8).reshape(1, 64) % 16
    packed = quant.pack_nibbles(q)
    assert packed.shape == (1, 32)
    assert packed[0, 0] == (q[0, 0] | (q[0, 16] << 4)) and packed[0, 16] == (q[0, 32] | (q[0, 48] << 4))
    assert np.array_equal(quant.unpack_nibbles(packed), q)


@pytest.mark.parametrize("n,k,group", [(96, 576, 32), (100, 576, 128), (64, 1536, 64), (17, 96, 32)])
@pytest.mark.parametrize("native", [True, False])
def test_int4_products_match_the_dequantized_float_product(n, k, group, native):
    """Few rows run the compiled product, many a de-quantized GEMM; without the kernels, torch ops.
    Every path equals the float product over the de-quantized weight up to float32 rounding, with
    the last group of a row shorter than the others (576 = 4.5 x 128), biases and residual adds."""
    if native and kernels() is None:
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(n + k)
    w = rng.standard_normal((n, k)).astype(np.float32)
    triple = quant.quantize_int4(w, group)
    ref = torch.from_numpy(quant.dequantize_int4(*triple, group))
    bias = torch.randn(n)
    lin = Int4Linear(*triple, group, bias=bias, int8_activations=False)
    if not native:
        lin.lib = None
    assert torch.equal(lin.dequantized(), ref)
    assert torch.equal(lin.dequantized(torch.bfloat16), ref.bfloat16())  # rounded to nearest even, as torch
    for rows in (1, 3, 8, 9, 64):
        x = torch.randn(rows, k)
        want = x @ ref.t() + bias
        got = lin(x)
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), rows
        out = torch.randn(rows, n)
        plain = Int4Linear(*triple, group, int8_activations=False)
        plain.lib = lin.lib
        expect = out + x @ ref.t()
        plain.add_into(out, x)
        assert torch.allclose(out, expect, rtol=1e-4, atol=1e-4 * float(expect.abs().max())), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_products_of_few_rows_match_torch(dtype):
    """fp32 and bf16 weights: up to the compiled product's rows on the CPU (`f_matmul`, float32 sums over
    the weight widened exactly) equal the float64 product over the same weight up to float32 rounding,
    with a bias and residual adds; more rows run `F.linear` (bf16 rows for a bf16 weight)."""
    from engine.qlinear import FloatLinear

    if kernels() is None:
        pytest.skip("no C compiler here")
    w = torch.randn(200, 592).to(dtype)  # 592 = 18.5 x 32: a last step of 16
    bias = torch.randn(200)
    lin = FloatLinear(w, bias)
    assert lin.max_rows == 8
    for rows in (1, 3, 8, 9):
        x = torch.randn(rows, 592)
        want = x.double() @ w.double().t() + bias.double()
        tol = (1e-5 if rows <= 8 or dtype == torch.float32 else 1e-2) * float(want.abs().max())
        assert float((lin(x).double() - want).abs().max()) <= tol, rows
        out = torch.randn(rows, 200)
        expect = out.double() + x.double() @ w.double().t()
        got = FloatLinear(w).add_into(out, x).double()
        assert float((got - expect).abs().max()) <= tol, rows


def _w4a8_reference(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """What the W4A8 product computes exactly: x quantized to int8 per block of 32 inputs (scale
    max|x| / 127, rounded to nearest even, in float32), times the de-quantized weight, in float64."""
    xb = x.numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(xb).max(axis=2, keepdims=True)
    inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    xq = np.rint(xb * inv) * (amax / np.float32(127.0))
    return torch.from_numpy(xq.reshape(x.shape).astype(np.float64)) @ ref.double().t()


@pytest.mark.parametrize("k,group", [(576, 32), (576, 128), (544, 32), (608, 64), (512, 32), (2048, 96)])
def test_int4_products_with_int8_activations_stay_within_their_rounding(k, group):
    """Where AVX-512 VNNI is compiled, products of few rows quantize the rows to int8 per 32 inputs
    (W4A8): they equal that computation done exactly up to float32 rounding, at every count of blocks
    left over by the kernel's steps of four (576, 544, 608, 512 inputs) and groups spanning several
    blocks; the relative RMS error against the float product over the same int4 weights stays under
    1% (the activations' rounding, about 0.5%), for one row and several, with residual adds."""
    lib = kernels()
    if lib is None or not lib.qm_int8_activations():
        pytest.skip("no AVX-512 VNNI product here")
    rng = np.random.default_rng(group + k)
    w = rng.standard_normal((300, k)).astype(np.float32)
    triple = quant.quantize_int4(w, group)
    ref = torch.from_numpy(quant.dequantize_int4(*triple, group))
    lin = Int4Linear(*triple, group)
    assert lin.int8_activations
    for rows in (1, 3, 8):
        x = torch.randn(rows, k)
        x[0, 32:64] = 0.0  # a block of zeros: scale 0
        exact = _w4a8_reference(x, ref)
        got = lin(x)
        assert float((got.double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max()), rows
        want = x @ ref.t()
        err = (got - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()
        assert err < 0.01, (rows, float(err))
        out = torch.zeros(rows, 300)
        lin.add_into(out, x)
        assert (out - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt() < 0.01


def test_prefetch_distance_never_changes_a_product():
    """`prefetch_rows` (EngineConfig.weight_prefetch_rows) only asks for rows ahead: int4 (float and
    int8 rows) and int8 products are bit for bit those without it, at distances short of, equal to and
    beyond the weight's rows; a negative distance is refused."""
    if kernels() is None:
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(7)
    w = rng.standard_normal((70, 576)).astype(np.float32)
    x = torch.randn(3, 576)
    for make in (lambda p: Int4Linear(*quant.quantize_int4(w, 32), 32, prefetch_rows=p),
                 lambda p: Int4Linear(*quant.quantize_int4(w, 32), 32, prefetch_rows=p, int8_activations=False),
                 lambda p: Int8Linear(*quant.quantize_int8(w), prefetch_rows=p)):
        base = make(0)(x)
        for p in (1, 4, 70, 1000):
            assert torch.equal(make(p)(x), base), p
        with pytest.raises(ValueError):
            make(-1)


@pytest.mark.parametrize("native", [True, False])
def test_int8_products_and_rows_match_the_dequantized_float_product(native):
    if native and kernels() is None:
        pytest.skip("no C compiler here")
    rng = np.random.default_rng(3)
    w = rng.standard_normal((300, 576)).astype(np.float32)
    q, scale = quant.quantize_int8(w)
    ref = torch.from_numpy(quant.dequantize_int8(q, scale))
    lin = Int8Linear(q, scale)
    if not native:
        lin.lib = None
    for rows in (1, 5, 8, 40):
        x = torch.randn(rows, 576)
        want = x @ ref.t()
        assert torch.allclose(lin(x), want, rtol=1e-4, atol=1e-4 * float(want.abs().max())), rows
    ids = torch.tensor([0, 7, 299, 7])
    assert torch.equal(lin.rows(ids, torch.float32), ref[ids])
    assert torch.equal(lin.dequantized(torch.bfloat16), ref.bfloat16())


def test_quantized_products_error_on_a_random_model_of_the_default_shapes():
    """Relative RMS error of each quantized product against float32 on Gaussian weights and rows of
    the default model's shapes (the LM head: 4096 of its rows). Gaussian weights are a hard case for
    min/max quantization (no outlier structure to exploit); bounds: int8 2%, int4 group 32 12%, group
    128 15%."""
    rng = np.random.default_rng(0)
    shapes = {"wqkv": (960, 576), "wo": (576, 576), "w_gate_up": (3072, 576), "w_down": (576, 1536),
              "lm_head": (4096, 576)}
    bounds = {"int8": 0.02, "int4-g32": 0.12, "int4-g128": 0.15}
    seen = {}
    for name, (n, k) in shapes.items():
        w = (rng.standard_normal((n, k)) / math.sqrt(k)).astype(np.float32)
        x = torch.from_numpy(rng.standard_normal((8, k)).astype(np.float32))
        want = x @ torch.from_numpy(w).t()
        lins = {"int8": Int8Linear(*quant.quantize_int8(w)),  # (int4 with int8 rows where VNNI is compiled)
                "int4-g32": Int4Linear(*quant.quantize_int4(w, 32), 32),
                "int4-g128": Int4Linear(*quant.quantize_int4(w, 128), 128)}
        for fmt, lin in lins.items():
            err = float(((lin(x) - want).pow(2).mean() / want.pow(2).mean()).sqrt())
            seen[(name, fmt)] = err
            assert err < bounds[fmt], (name, fmt, err)
    assert all(seen[(n, "int8")] < seen[(n, "int4-g32")] < seen[(n, "int4-g128")] for n in shapes)


def test_q4_0_and_q4_1_blocks_repack_without_changing_a_value():
    """GGUF blocks written by the gguf package's own quantizer: repacked into int4 group 32, the values
    are exactly what the package de-quantizes."""
    gguf = pytest.importorskip("gguf")
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    for qtype, ggml in [(gguf.GGMLQuantizationType.Q4_0, quant.GGUF_Q4_0),
                        (gguf.GGMLQuantizationType.Q4_1, quant.GGUF_Q4_1)]:
        try:
            raw = gguf.quants.quantize(w, qtype)
        except (NotImplementedError, gguf.quants.QuantError):
            pytest.skip(f"this gguf package cannot write {qtype.name}")
        want = gguf.quants.dequantize(raw, qtype).astype(np.float32)
        triple = quant.int4_from_gguf(raw, ggml, 128)
        assert np.array_equal(quant.dequantize_int4(*triple, 32), want), qtype.name
        assert np.array_equal(quant.dequantize_gguf(raw, ggml, 128), want)


def test_the_default_models_q4_1_tensors_repack_exactly(resolved_model):
    """The default GGUF's Q4_1 layers, repacked (and un-permuted for Llama's rope as transformers'
    reader does), de-quantize to exactly the float32 values transformers' GGUF reader produced."""
    from engine.loader import read_safetensors
    from engine.weightcache import _Gguf

    cfg = json.loads((resolved_model.directory / "config.json").read_text())
    src = _Gguf.of(resolved_model.directory, cfg["num_attention_heads"], cfg["num_key_value_heads"])
    assert src is not None
    tensors = read_safetensors(resolved_model.directory)
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"):
        name = f"model.layers.{cfg['num_hidden_layers'] - 1}.{proj}.weight"
        want = np.asarray(tensors[name])
        triple = src.int4(name, *want.shape)
        assert triple is not None, name
        assert np.array_equal(quant.dequantize_int4(*triple, 32), want), name


@pytest.fixture(scope="module")
def formats(resolved_model):
    """The default model in fp32, bf16, int8, int4 (group 32, int8 head) and int4 group 128."""
    from engine.config import EngineConfig
    from engine.model import Transformer

    return {name: Transformer.from_directory(resolved_model.directory, EngineConfig(device="cpu", weights=name),
                                             fingerprint=resolved_model.fingerprint)
            for name in ("fp32", "bf16", "int8", "int4", "int4-g128", "int4-g128-gptq")}


def test_tied_model_reads_its_embeddings_from_the_int8_head(formats):
    from engine.qlinear import FloatLinear

    m = formats["int4"]
    assert m.weight_format == "int4-g32"
    assert m.w.embed.table is None and m.w.embed.head is m.w.lm_head and isinstance(m.w.lm_head, Int8Linear)
    assert isinstance(m.w.layers[0].wqkv, Int4Linear) and isinstance(formats["fp32"].w.lm_head, FloatLinear)
    ids = torch.tensor([1, 500, 49151])
    ref = formats["fp32"].w.embed(ids)
    got = m.w.embed(ids)
    assert float((got - ref).abs().max()) <= float(ref.abs().max()) / 100


def test_many_rows_multiply_in_bfloat16_where_the_cpu_does(formats, resolved_model):
    """`quantized_prefill_bf16` (on by default): int4 and int8 products of more rows than decode's
    multiply in bfloat16 where the CPU does so itself (AVX-512 BF16, AMX), within bfloat16 rounding of
    the float product; switched off, or on other CPUs, float32. Attention then goes bfloat16 too. What
    it does to perplexity: test_perplexity_of_each_format_against_float32."""
    from engine.config import EngineConfig
    from engine.attention import bf16_attention_kernel
    from engine.model import Transformer
    from engine.qlinear import bf16_products_here

    off = Transformer.from_directory(resolved_model.directory, EngineConfig(device="cpu", weights="int4",
                                                                            quantized_prefill_bf16=False),
                                     fingerprint=resolved_model.fingerprint)
    here = bf16_products_here() and kernels() is not None
    for m, bf16 in ((formats["int4"], here), (off, False)):
        assert m.bf16_attention == (bf16 and bf16_attention_kernel() is not None)
        for lin in (m.w.layers[0].w_gate_up, m.w.lm_head):  # int4, and the int8 head
            assert lin.bf16_rows == bf16
            x = torch.randn(64, lin.k)
            want = x.double() @ lin.dequantized().double().t()
            out = torch.randn(64, lin.n)
            added = lin.add_into(out.clone(), x).double() - out.double()
            for got in (lin(x).double(), added):
                err = float((got - want).norm() / want.norm())
                assert (1e-4 < err < 1e-2) if bf16 else err < 1e-5, (type(lin).__name__, bf16, err)


def test_perplexity_of_each_format_against_float32(formats, engine):
    """Perplexity on the benchmark suite's real text (three windows of 384 tokens of the Python
    reference manual): bf16 within +0.5% of float32 (its products, attention's too where the CPU
    has AMX or AVX-512 BF16, in bfloat16), int8 within +1%, int4 group 32 with the int8 head within +3%.
    int4 group 128 re-quantizes weights that are already 4-bit in groups of 32 (the default GGUF is
    Q4_1) onto a coarser grid: rounding each weight measured +41% (19.92 -> 28.13), GPTQ on
    calibration text (int4-g128-gptq, engine/gptq.py) +6.9% (21.29): within the +10% issue 27 asks
    for; +50% for rounding catches a regression, docs/benchmarks.md ("Quantized weights") has the
    figures."""
    from bench.accuracy import real_text_ids, window_starts

    ids = real_text_ids(engine.tok)
    width = 384
    ppl = {}
    for name, m in formats.items():
        nll, count = 0.0, 0
        for s in window_starts(len(ids), 3, width):
            window = ids[s : s + width]
            logits = m.forward(m.new_cache(width), window, all_logits=True)
            lp = torch.log_softmax(logits[:-1].float(), dim=-1)
            nll -= float(lp.gather(1, torch.tensor(window[1:]).unsqueeze(1)).sum())
            count += width - 1
        ppl[name] = math.exp(nll / count)
    assert ppl["bf16"] <= ppl["fp32"] * 1.005, ppl
    assert ppl["int8"] <= ppl["fp32"] * 1.01, ppl
    assert ppl["int4"] <= ppl["fp32"] * 1.03, ppl
    assert ppl["int4-g128"] <= ppl["fp32"] * 1.50, ppl
    assert ppl["int4-g128-gptq"] <= ppl["fp32"] * 1.10 and ppl["int4-g128-gptq"] < ppl["int4-g128"], ppl
    assert len(set(ppl.values())) == len(ppl), ppl  # each format really ran its own weights


def test_lookup_decoding_in_int4_checks_its_guess_in_decodes_products(formats, engine):
    """int4 decode rows go through the compiled W4A8 product, up to its row limit: a lookup pass checks
    at most that many rows, so a guessed token is computed exactly as decoding it alone would."""
    from engine.config import EngineConfig
    from engine.context import ContextEngine
    from tests.engine.test_lookup import PROMPT, SYSTEM

    m = formats["int4"]
    plain = ContextEngine(m, engine.tok, EngineConfig(weights="int4"))
    fast = ContextEngine(m, engine.tok, EngineConfig(weights="int4", lookup_draft=16))
    assert fast.pass_rows == 8
    a = plain.call(plain.new_ctx(SYSTEM), PROMPT, max_tokens=40)
    b = fast.call(fast.new_ctx(SYSTEM), PROMPT, max_tokens=40)
    assert b.token_ids == a.token_ids
    assert fast.lookup.kept > 10 and fast.lookup.guessed <= 7 * fast.lookup.passes


def test_a_second_load_converts_nothing(resolved_model, formats):
    """The converted file is cached: loading again maps it (same file, no rewrite)."""
    from engine.loader import cache_root

    path = cache_root() / "fused" / f"{resolved_model.fingerprint}-int4-g32.safetensors"
    before = path.stat()
    from engine.config import EngineConfig
    from engine.model import Transformer

    Transformer.from_directory(resolved_model.directory, EngineConfig(device="cpu", weights="int4"),
                               fingerprint=resolved_model.fingerprint)
    after = path.stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)


def _run(code: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         env={**os.environ, **(env or {})}, timeout=300, cwd=os.getcwd())
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_conversion_memory_stays_under_one_and_a_half_times_the_converted_size(resolved_model, tmp_path):
    """In a fresh process (the baseline taken after imports), converting the default model to int8
    (every matrix re-quantized from floats, the 49152-row head included; int4 at other group sizes
    takes the same streaming path) raises ru_maxrss by less than 1.5x the converted file's size."""
    code = f"""
        import json, resource
        from pathlib import Path
        import numpy as np, torch
        from engine.config import ModelConfig
        from engine.loader import read_safetensors
        from engine.layout import layout
        from engine.quant import WeightFormat
        from engine.weightcache import converted_weights
        d = Path({str(resolved_model.directory)!r})
        cfg = ModelConfig.from_hf(json.loads((d / "config.json").read_text()))
        names = list(read_safetensors(d).keys())
        out = {{}}
        for tag in ("int8",):
            fmt = WeightFormat.parse(tag)
            base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            arrays = converted_weights(d, "f" * 32, fmt, layout(cfg, names, fmt), tied=cfg.tie_embeddings,
                                       heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, progress=False)
            grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
            size = sum(a.nbytes for a in arrays.values())
            del arrays
            out[tag] = [grew, size]
        print(json.dumps(out))
    """
    got = _run(code, {"LLMAAS_CACHE_DIR": str(tmp_path)})
    for tag, (grew, size) in got.items():
        assert size > 20 << 20 and grew < 1.5 * size, (tag, grew, size)


def test_untied_embeddings_stay_on_flash(tmp_path):
    """An untied model loaded as int4 reads its embedding rows from the mapped file: anonymous memory
    after loading holds the quantized layers and the int8 head, not the 64 MB float table."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "m")
    code = f"""
        import json
        from engine.config import EngineConfig
        from engine.model import Transformer
        import torch

        def status():
            fields = {{}}
            for line in open("/proc/self/status"):
                key, _, value = line.partition(":")
                if key in ("RssAnon", "RssFile"):
                    fields[key] = int(value.split()[0]) * 1024
            return fields
        Transformer.from_directory({str(tmp_path / "m")!r}, EngineConfig(device="cpu", weights="int4"))  # convert
        before = status()
        m = Transformer.from_directory({str(tmp_path / "m")!r}, EngineConfig(device="cpu", weights="int4"))
        m.forward(m.new_cache(16), list(range(0, 32000, 2000)))
        after = status()
        table = m.w.embed.table
        print(json.dumps({{"anon": after["RssAnon"] - before["RssAnon"], "table": table.numel() * table.element_size(),
                          "dtype": str(table.dtype)}}))
    """
    got = _run(code, {"LLMAAS_CACHE_DIR": str(tmp_path / "cache")})
    assert got["table"] == 32000 * 512 * 4 and got["dtype"] == "torch.float32"
    assert got["anon"] < got["table"] / 2, got
