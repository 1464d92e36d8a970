"""The weight formats (engine.quant) on CUDA (device from the environment): a model converted to
bf16, int8 and int4 loads its stored values onto the device, and under a float32 compute dtype its
logits there equal the same format's logits on the CPU up to float summation order (both multiply
by the same stored values; the CPU's int4 and int8 products run with float rows here,
`int8_activations=False` and `quantized_prefill_bf16=False`, so that nothing but the order of the sums
differs). Decode through the chunked cache follows the prefill's logits. Under bfloat16 compute, int4
runs torch's packed int4 kernel and tracks the float32-compute run; int4 stored symmetric (a GGUF's
Q4_0 blocks, no minimums) computes the same on the device as on the CPU, packed or not.

Skipped when torch sees no CUDA device, so CI on the CPU skips it. `LLMAAS_TEST_DEVICE=cpu` runs the
same checks on the CPU (how this file is debugged without a GPU); the default is `cuda`.

The checkpoint is a small random-weight Llama written by transformers (safetensors), so every format
is quantized at conversion here; the GGUF repack is tested on the CPU (tests/engine/test_quant.py).
"""

from __future__ import annotations


import pytest
import torch

from engine.config import EngineConfig
from engine.model import Transformer
from engine.qlinear import FloatLinear, Int4Linear, Int8Linear
from engine.quant import symmetric_minimums
from tests.engine.test_cuda import CFG, DEVICE, pytestmark as cuda_only

pytestmark = [cuda_only, pytest.mark.usefixtures("private_model_cache")]  # test_cuda.py's skip

N_PROMPT = 90
FORMATS = {"bf16": FloatLinear, "int8": Int8Linear, "int4": Int4Linear, "int4-g128": Int4Linear}


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("cuda-formats")
    model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=False))
    model.eval().save_pretrained(root / "llama")
    return root / "llama"


def _load(checkpoint, device: str, weights: str, dtype: str = "float32") -> Transformer:
    return Transformer.from_directory(checkpoint, EngineConfig(device=device, dtype=dtype, weights=weights,
                                                               int8_activations=False,
                                                               quantized_prefill_bf16=False))


@pytest.mark.parametrize("weights", list(FORMATS))
def test_each_format_on_the_device_matches_the_same_format_on_the_cpu(checkpoint, weights):
    host = _load(checkpoint, "cpu", weights)
    dev = _load(checkpoint, DEVICE, weights)
    layer = dev.w.layers[0]
    assert isinstance(layer.wqkv, FORMATS[weights]) and layer.wqkv.device.type == torch.device(DEVICE).type
    assert dev.w.lm_head.device.type == torch.device(DEVICE).type
    assert dev.weight_format == host.weight_format
    seq = _ids(N_PROMPT, 1)
    ref = host.forward(host.new_cache(N_PROMPT), seq, all_logits=True)
    got = dev.forward(dev.new_cache(N_PROMPT), seq, all_logits=True)
    assert got.device.type == torch.device(DEVICE).type and got.dtype == torch.float32
    err = (got.cpu() - ref).abs().max().item()
    # quantized formats de-quantize to float32 rows; bf16 weights take bfloat16 rows (8-bit mantissa)
    # for many rows, and on the CPU float32 rows for few (decode's compiled products)
    tol = (2e-2 if weights == "bf16" else 1e-4) * max(ref.abs().max().item(), 1.0)
    print(f"{weights} on {DEVICE}: max |logit diff| to the CPU {err:.2e} (bound {tol:.2e})")
    assert err < tol, f"{weights}: {err:.2e}"
    # decode one token at a time through the device's chunked cache: the teacher-forced logits again
    cache = dev.new_cache(16)
    logits = dev.forward(cache, seq[:40])
    for k, t in enumerate(seq[40:60]):
        assert (logits - got[39 + k]).abs().max().item() < tol
        logits = dev.forward(cache, [t])


@pytest.mark.parametrize("rows", [1, 40])
def test_symmetric_int4_on_the_device_matches_the_cpu(rows):
    """int4 without minimums (`mins` None: each -8 times its scale) on the device: float32 rows give the
    CPU's product up to summation order; bfloat16 rows through torch's packed kernel (zero 0 in its
    `[scale, zero]` pairs) give the float32 product within bfloat16 rounding."""
    gen = torch.Generator().manual_seed(7)
    n, k, group = 96, 256, 32
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scale = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).half()
    x = torch.randn(rows, k, generator=gen)
    host = Int4Linear(q, scale, None, group, int8_activations=False)
    want = host(x)
    mins = symmetric_minimums(scale.numpy())  # what Q4_0's blocks stand for
    assert torch.equal(host.dequantized(), Int4Linear(q, scale, mins, group).dequantized())
    dev = Int4Linear(q, scale, None, group, device=DEVICE, int8_activations=False)
    got = dev(x.to(DEVICE)).cpu()
    assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()
    packed = Int4Linear(q, scale, None, group, device=DEVICE, device_pack=True)
    if torch.device(DEVICE).type == "cuda" and torch.cuda.get_device_capability() >= (8, 0):
        assert packed.packed is not None
    got16 = packed(x.to(DEVICE, torch.bfloat16)).float().cpu()
    err = (got16 - want).abs().max().item()
    print(f"symmetric int4 on {DEVICE}, {rows} rows: float32 {(got - want).abs().max().item():.2e}, "
          f"bfloat16 {err:.2e} of {want.abs().max().item():.2e}")
    assert err < 2e-2 * want.abs().max().item()


def test_int4_under_bfloat16_compute_tracks_float32_compute(checkpoint):
    """int4 weights with a bfloat16 working set (the CUDA default dtype): the top-1 token agrees with
    the float32-compute run of the same weights at most positions, and nothing is NaN."""
    f32 = _load(checkpoint, DEVICE, "int4")
    b16 = _load(checkpoint, DEVICE, "int4", "bfloat16")
    assert b16.new_cache(1).kv.dtype == torch.bfloat16
    if torch.device(DEVICE).type == "cuda" and torch.cuda.get_device_capability() >= (8, 0):
        wqkv = b16.w.layers[0].wqkv  # packed for torch's int4 kernel; the stored values stay on the host
        assert wqkv.packed is not None and wqkv.q.device.type == "cpu" and wqkv.device.type == "cuda"
        assert f32.w.layers[0].wqkv.packed is None  # float32 compute de-quantizes (equal to the CPU's)
    seq = _ids(N_PROMPT, 2)
    a = f32.forward(f32.new_cache(N_PROMPT), seq, all_logits=True)
    b = b16.forward(b16.new_cache(N_PROMPT), seq, all_logits=True)
    assert torch.isfinite(b).all()
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"int4 on {DEVICE}: top-1 agreement bfloat16 against float32 compute {agree:.3f}")
    assert agree >= 0.85


def test_an_adapter_on_the_device_matches_the_same_adapter_on_the_cpu(checkpoint, tmp_path):
    """LoRA deltas (engine.lora) on the device: the same logits as on the CPU under float32 compute;
    on int4 weights, bfloat16 compute picks the float32 compute's top-1 token at most positions."""
    from bench.model_files import random_adapter
    from engine.lora import AdapterSet

    host = _load(checkpoint, "cpu", "fp32")
    random_adapter(tmp_path / "a", host.cfg, seed=3, rank=8,
                   targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    seq = _ids(N_PROMPT, 3)
    ref = host.forward(host.new_cache(N_PROMPT), seq, all_logits=True,
                       adapter=AdapterSet(tmp_path, host.cfg).add("a", "a"))
    assert (ref - host.forward(host.new_cache(N_PROMPT), seq, all_logits=True)).abs().max() > 0.1  # it matters
    dev = _load(checkpoint, DEVICE, "fp32")
    a = AdapterSet(tmp_path, dev.cfg, device=dev.device, dtype=dev.dtype).add("a", "a")
    assert a.layers[0]["wqkv"].a.device.type == torch.device(DEVICE).type
    got = dev.forward(dev.new_cache(N_PROMPT), seq, all_logits=True, adapter=a)
    assert (got.cpu() - ref).abs().max().item() < 1e-4 * max(ref.abs().max().item(), 1.0)
    q32, b16 = _load(checkpoint, DEVICE, "int4"), _load(checkpoint, DEVICE, "int4", "bfloat16")
    want = q32.forward(q32.new_cache(N_PROMPT), seq, all_logits=True,
                       adapter=AdapterSet(tmp_path, q32.cfg, device=q32.device).add("a", "a"))
    a16 = AdapterSet(tmp_path, b16.cfg, device=b16.device, dtype=b16.dtype).add("a", "a")
    got16 = b16.forward(b16.new_cache(N_PROMPT), seq, all_logits=True, adapter=a16)
    agree = (got16.argmax(-1) == want.argmax(-1)).float().mean().item()
    print(f"adapter on {DEVICE}, int4 weights: top-1 agreement of bfloat16 with float32 compute {agree:.3f}")
    assert torch.isfinite(got16).all() and agree >= 0.85


def test_a_kv8_working_set_on_the_device_matches_the_cpu(checkpoint):
    """The kv8 working set (engine/kvformat.py) on the device: packed and de-quantized there, its
    logits follow the CPU's kv8 run (a code may round the other way where the device's K/V differ in
    the last bits), chunks leave and come back as the same bytes, and bfloat16 compute over it picks
    the float32 run's top-1 token at most positions."""
    import numpy as np

    host = _load(checkpoint, "cpu", "fp32")
    dev = _load(checkpoint, DEVICE, "fp32")
    seq = _ids(N_PROMPT, 4)
    ref = host.forward(host.new_cache(N_PROMPT, "kv8"), seq, all_logits=True)
    cache = dev.new_cache(N_PROMPT, "kv8")
    assert cache.kv.dtype == torch.uint8 and cache.kv.device.type == torch.device(DEVICE).type
    got = dev.forward(cache, seq, all_logits=True)
    err = (got.cpu() - ref).abs().max().item()
    print(f"kv8 on {DEVICE}: max |logit diff| to the CPU {err:.2e}")
    assert err < 2e-2 * max(ref.abs().max().item(), 1.0)
    rows = cache.export_chunk(2)
    cache.drop_chunk(2)
    cache.put_chunk(2, rows)
    assert np.array_equal(cache.export_chunk(2), rows)
    b16 = _load(checkpoint, DEVICE, "fp32", "bfloat16")
    b = b16.forward(b16.new_cache(N_PROMPT, "kv8"), seq, all_logits=True)
    agree = (b.float().cpu().argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"kv8 on {DEVICE}: top-1 agreement bfloat16 against float32 compute {agree:.3f}")
    assert torch.isfinite(b).all() and agree >= 0.85


def test_partitioned_prefill_on_the_device_equals_one_pass(checkpoint):
    """Layer-major row partitions (`EngineConfig.prefill_partition_rows`) on the device: the logits of
    one pass, in float32 and in bfloat16 compute, after a context already holding tokens."""
    seq = _ids(N_PROMPT, 5)
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 5e-2)):
        m = _load(checkpoint, DEVICE, "fp32", dtype)
        out = {}
        for rows in (0, 32):
            m.engine_cfg.prefill_partition_rows = rows
            cache = m.new_cache(N_PROMPT)
            m.forward(cache, seq[:10])
            out[rows] = m.forward(cache, seq[10:], all_logits=True).float()
        err = (out[32] - out[0]).abs().max().item()
        print(f"partitioned prefill on {DEVICE} in {dtype}: max |logit diff| {err:.2e}")
        assert err < tol * max(out[0].abs().max().item(), 1.0)
