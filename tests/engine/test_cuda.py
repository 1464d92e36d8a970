"""The engine on CUDA (device from the config): parity with transformers on the same device in float32
and bfloat16, density, recompute, the KV chunk moves through host numpy and the storage codecs, and
the compiled CPU kernels kept away from device tensors.

Skipped when torch sees no CUDA device, so CI on the CPU skips it. `LLMAAS_TEST_DEVICE=cpu` runs the
same checks on the CPU (how this file is debugged without a GPU); the default is `cuda`.

The checkpoint is a small Llama built here from random weights with transformers (as in
test_checkpoints.py), with head dim 64 like the default model, so nothing here needs the default
model's package.
"""

from __future__ import annotations

import copy
import os

import numpy as np
import pytest
import torch

from engine.config import EngineConfig
from engine.model import Transformer

DEVICE = os.environ.get("LLMAAS_TEST_DEVICE", "cuda")

pytestmark = pytest.mark.skipif(
    torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available(),
    reason="CUDA checks: torch.cuda.is_available() is False on this machine "
    "(set LLMAAS_TEST_DEVICE=cpu to run them on the CPU)",
)

CFG = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention, head dim 64
    max_position_embeddings=512,
    rope_theta=10000.0,
    initializer_range=0.08,  # sharper than the default 0.02: greedy choices are not near-ties
)
N_PROMPT = 90  # five full chunks of 16 and a partial sixth
N_NEW = 24
F32_LOGIT_TOL = 1e-4
NEAR_TIE = 1e-4


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, CFG["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _build(directory, kind: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**CFG, tie_word_embeddings=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(**CFG, tie_word_embeddings=True))
    with torch.no_grad():  # random init leaves norms at one and biases at zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(directory)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (directory, transformers model in float32 on the CPU)."""
    root = tmp_path_factory.mktemp("cuda-ckpt")
    return {kind: (root / kind, _build(root / kind, kind)) for kind in ("llama", "qwen2")}


@pytest.fixture(scope="module")
def f32(checkpoints):
    d, hf = checkpoints["llama"]
    m = Transformer.from_directory(d, EngineConfig(device=DEVICE, dtype="float32"))
    return m, copy.deepcopy(hf).to(DEVICE).eval()


@pytest.fixture(scope="module")
def bf16(checkpoints):
    """The engine in its default dtype on the device (bfloat16 on CUDA), transformers in bfloat16."""
    d, hf = checkpoints["llama"]
    dtype = "auto" if torch.device(DEVICE).type == "cuda" else "bfloat16"
    m = Transformer.from_directory(d, EngineConfig(device=DEVICE, dtype=dtype))
    assert m.dtype == torch.bfloat16
    return m, copy.deepcopy(hf).to(device=DEVICE, dtype=torch.bfloat16).eval()


def hf_logits(hf, seq) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([seq], device=DEVICE)).logits[0].float()


def hf_greedy(hf, prompt, n) -> list[int]:
    with torch.inference_mode():
        out = hf.generate(input_ids=torch.tensor([prompt], device=DEVICE), attention_mask=torch.ones(
            1, len(prompt), dtype=torch.long, device=DEVICE), max_new_tokens=n,
            do_sample=False, pad_token_id=0)
    cont = out[0, len(prompt):].tolist()
    assert len(cont) == n, f"transformers stopped after {len(cont)} tokens"
    return cont


def engine_greedy(m: Transformer, cache, logits, n) -> tuple[list[int], list[torch.Tensor]]:
    """`n` greedy tokens after `logits`, decoding one token at a time into `cache`; the tokens and the
    logits each was chosen from."""
    out, seen = [], []
    for _ in range(n):
        seen.append(logits)
        t = int(logits.argmax())
        out.append(t)
        logits = m.forward(cache, [t])
    return out, seen


def margin(logits: torch.Tensor) -> torch.Tensor:
    top2 = logits.float().topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def clone_cache(m: Transformer, cache):
    c = m.new_cache(cache.capacity)
    c.kv.copy_(cache.kv)
    c.length, c.missing = cache.length, set(cache.missing)
    return c


# ---- parity with transformers on the same device ----------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_float32_matches_transformers_logits_and_greedy_decode(checkpoints, kind):
    d, hf_cpu = checkpoints[kind]
    m = Transformer.from_directory(d, EngineConfig(device=DEVICE, dtype="float32"))
    assert m.device.type == torch.device(DEVICE).type and m.dtype == torch.float32
    assert m.w.embed.device.type == m.device.type and m.cos.device.type == m.device.type
    hf = copy.deepcopy(hf_cpu).to(DEVICE).eval()
    prompt = _ids(N_PROMPT, 1)
    ref_cont = hf_greedy(hf, prompt, N_NEW)
    seq = prompt + ref_cont
    ref = hf_logits(hf, seq)
    got = m.forward(m.new_cache(len(seq)), seq, all_logits=True)
    assert got.device.type == m.device.type and got.dtype == torch.float32
    err = (got - ref).abs().max().item()
    print(f"{kind} float32 on {DEVICE}: max |logit diff| {err:.2e}, smallest top-2 margin in the "
          f"continuation {margin(ref[N_PROMPT - 1 :]).min().item():.2e}")
    assert err < F32_LOGIT_TOL, f"{kind}: max |logit diff| {err:.2e} to transformers float32 on {DEVICE}"
    # the engine's own decode: chunked KV, one token at a time, token for token with transformers
    cache = m.new_cache(16)  # grows while decoding: capacity doubling on the device
    out, seen = engine_greedy(m, cache, m.forward(cache, prompt), N_NEW)
    assert cache.length == N_PROMPT + N_NEW and cache.capacity >= cache.length
    ref_margin = margin(ref[N_PROMPT - 1 : N_PROMPT - 1 + N_NEW])
    for k, (a, b) in enumerate(zip(out, ref_cont)):
        if a != b:
            assert ref_margin[k] < NEAR_TIE, f"{kind}: token {k} is {a}, transformers {b}, margin {ref_margin[k]:.2e}"
            break
    else:
        assert out == ref_cont
    dec = torch.stack(seen)  # decode-step logits against the teacher-forced ones
    assert (dec - got[N_PROMPT - 1 : N_PROMPT - 1 + N_NEW]).abs().max().item() < F32_LOGIT_TOL


def test_bfloat16_default_dtype_tracks_transformers(f32, bf16):
    """bfloat16 (the default on CUDA): the engine is about as close to float32 as transformers' own
    bfloat16 is, and picks the same top-1 token at almost every position."""
    m32, hf32 = f32
    m16, hf16 = bf16
    prompt = _ids(N_PROMPT, 2)
    seq = prompt + hf_greedy(hf32, prompt, N_NEW)
    exact = hf_logits(hf32, seq)
    ref16 = hf_logits(hf16, seq)
    got = m16.forward(m16.new_cache(len(seq)), seq, all_logits=True)
    assert got.dtype == torch.float32 and m16.new_cache(1).kv.dtype == torch.bfloat16
    e_engine = (got - exact).abs().max().item()
    e_hf = (ref16 - exact).abs().max().item()
    scale = exact.abs().max().item()
    print(f"bf16 on {DEVICE}: max |logit err| engine {e_engine:.3e}, transformers {e_hf:.3e} (|logits| <= {scale:.2f})")
    assert e_engine < 2 * e_hf + 0.01 * scale, f"engine bf16 err {e_engine:.3e}, transformers bf16 {e_hf:.3e}"
    agree_hf = (got.argmax(-1) == ref16.argmax(-1)).float().mean().item()
    agree_exact = (got.argmax(-1) == exact.argmax(-1)).float().mean().item()
    hf_exact = (ref16.argmax(-1) == exact.argmax(-1)).float().mean().item()
    print(f"top-1 agreement: engine-bf16 vs hf-bf16 {agree_hf:.3f}, vs float32 {agree_exact:.3f}; hf-bf16 vs float32 {hf_exact:.3f}")
    # random weights have many close top-2 pairs (on the CPU, over six prompts: 0.95 to 0.99 agreement)
    assert agree_hf >= 0.85 and agree_exact >= hf_exact - 0.06
    # decode in bfloat16: the first greedy tokens agree with transformers' bfloat16 (exact on clear margins)
    cache = m16.new_cache(N_PROMPT + N_NEW)
    out, _ = engine_greedy(m16, cache, m16.forward(cache, prompt), 8)
    ref_out = hf_greedy(hf16, prompt, 8)
    clear = margin(exact[N_PROMPT - 1 : N_PROMPT + 7]) > 4 * max(e_engine, e_hf)
    first_diff = next((k for k, (a, b) in enumerate(zip(out, ref_out)) if a != b), len(out))
    assert first_diff == len(out) or not clear[: first_diff + 1].all(), (out, ref_out)


def test_sdpa_and_density_on_device(f32, checkpoints):
    """The fused-attention forward gives the same logits; density (attention column sums, summed over
    heads and layers) matches transformers' eager attention matrices on the same device."""
    m, _ = f32
    d, hf_cpu = checkpoints["llama"]
    seq = _ids(N_PROMPT, 3)
    dens = torch.zeros(N_PROMPT + 1, device=m.device)
    a = m.forward(m.new_cache(N_PROMPT + 1), seq, all_logits=True, density=dens[:N_PROMPT])
    b = m.forward(m.new_cache(N_PROMPT), seq, all_logits=True, sdpa=True)
    assert (a - b).abs().max().item() < F32_LOGIT_TOL
    eager = copy.deepcopy(hf_cpu)
    eager.config._attn_implementation = "eager"
    eager = eager.to(DEVICE).eval()
    with torch.inference_mode():
        att = eager(torch.tensor([seq], device=DEVICE), output_attentions=True).attentions  # L x [1, H, S, S]
    ref = torch.stack([x[0].double() for x in att]).sum(dim=(0, 1, 2))  # [S]
    assert dens.device.type == m.device.type
    assert (dens[:N_PROMPT].double() - ref).abs().max().item() < 1e-3
    assert dens[N_PROMPT].item() == 0.0  # nothing written past the rows' keys


def test_recompute_interleaved_chunks_on_device(f32):
    m, _ = f32
    ids = _ids(N_PROMPT, 4)
    cache = m.new_cache(N_PROMPT + N_NEW)
    logits = m.forward(cache, ids)
    k0, v0 = cache.k[:, :, :N_PROMPT].clone(), cache.v[:, :, :N_PROMPT].clone()
    cont, _ = engine_greedy(m, clone_cache(m, cache), logits, 12)
    for chunks in ([1, 3], [0, 2, 5]):
        c = clone_cache(m, cache)
        for i in chunks:
            c.drop_chunk(i)
        assert torch.isnan(c.k[:, :, :N_PROMPT]).any()
        m.recompute(c, ids, chunks)
        assert not c.missing
        assert (c.k[:, :, :N_PROMPT] - k0).abs().max().item() < 1e-4
        assert (c.v[:, :, :N_PROMPT] - v0).abs().max().item() < 1e-4
        assert engine_greedy(m, c, logits, 12)[0] == cont


# ---- KV chunks through host memory and the codecs ---------------------------------------------------
@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def prefilled(request, f32, bf16):
    """(model, cache prefilled with N_PROMPT tokens, its last logits, the tokens that follow)."""
    m = f32[0] if request.param == "float32" else bf16[0]
    cache = m.new_cache(N_PROMPT + N_NEW)
    logits = m.forward(cache, _ids(N_PROMPT, 5))
    return m, cache, logits, _ids(N_NEW, 6)


def test_exported_chunks_import_into_a_new_cache_bit_exact(prefilled):
    """export_chunk -> host numpy -> put_chunk into a fresh cache: the same K/V bits, and the
    continuation's logits equal those of the uninterrupted cache."""
    m, cache, logits, more = prefilled
    arrays = [cache.export_chunk(i) for i in range(cache.n_chunks)]
    want = np.float32 if m.dtype == torch.float32 else np.uint16  # bfloat16 travels as its bits
    for i, a in enumerate(arrays):
        s, e = cache.chunk_range(i)
        assert isinstance(a, np.ndarray) and a.dtype == want and a.flags.c_contiguous
        assert a.shape == (m.cfg.n_layers, 2, m.cfg.n_kv_heads, e - s, m.cfg.head_dim)
    fresh = m.new_cache(cache.capacity)  # the same geometry: the same kernels, so the same bits
    fresh.reserve(cache.length)
    fresh.missing = set(range(fresh.n_chunks))
    for i, a in enumerate(arrays):
        fresh.put_chunk(i, a)
    assert not fresh.missing and fresh.kv.device.type == m.device.type
    assert torch.equal(fresh.kv[:, :, :, : cache.length], cache.kv[:, :, :, : cache.length])
    a = m.forward(clone_cache(m, cache), more, all_logits=True)
    b = m.forward(fresh, more, all_logits=True)
    assert torch.equal(a, b)
    # chunk_array (the write-back's source) is a host copy off the CPU, the same values
    ca = cache.chunk_array(2)
    assert isinstance(ca, np.ndarray) and np.array_equal(ca, arrays[2])
    if m.device.type != "cpu":
        cache2 = clone_cache(m, cache)
        ca2 = cache2.chunk_array(2)
        cache2.drop_chunk(2)  # writes the device slots: the host copy keeps its values
        assert np.array_equal(ca2, arrays[2])


def test_rag_spans_move_through_the_host_and_continue_exactly(prefilled):
    """engine.rag: slots at any offset copied to host arrays (bfloat16 as its bits) and put back into a
    fresh cache, through that cache's own slots; the continuation's logits are those of the
    uninterrupted cache, as a RAG call's from cached nodes are."""
    from engine.rag import put_span, span_kv

    m, cache, logits, more = prefilled
    cuts = [0, 23, 61, N_PROMPT]
    spans = [span_kv(cache, a, b) for a, b in zip(cuts, cuts[1:])]
    assert spans[0].dtype == (np.float32 if m.dtype == torch.float32 else np.uint16)
    fresh = m.new_cache(cache.capacity)
    for a, kv in zip(cuts, spans):
        put_span(fresh, a, kv)
    assert fresh.length == N_PROMPT and torch.equal(fresh.kv[:, :, :, :N_PROMPT], cache.kv[:, :, :, :N_PROMPT])
    assert torch.equal(m.forward(clone_cache(m, cache), more, all_logits=True), m.forward(fresh, more, all_logits=True))


LEVELS = ["raw", "fp16", "bf16", "q8", "q4", "q2"]


def test_codecs_round_trip_chunks_exported_from_the_device(prefilled):
    """The write-back encodes `chunk_array` (host numpy) and the restore decodes on the host then
    `put_chunk`s into the device cache (actors/restore.py off the CPU): every level round trips
    within its bound, raw bit for bit with the same continuation."""
    from storage import codecs

    m, cache, logits, more = prefilled
    dtype = "float32" if m.dtype == torch.float32 else "bfloat16"
    ref_next = m.forward(clone_cache(m, cache), more, all_logits=True)
    for level in LEVELS:
        c = clone_cache(m, cache)
        for i in range(c.n_chunks):
            src = cache.chunk_array(i)
            enc = codecs.encode(src, level, dtype=dtype)
            assert enc.dtype == dtype and enc.payload.dtype == np.uint8
            c.drop_chunk(i)
            out = codecs.decode(enc)
            assert out.dtype == src.dtype and out.shape == src.shape
            x = torch.from_numpy(src.view(np.uint16) if dtype == "bfloat16" else src)
            y = torch.from_numpy(out)
            if dtype == "bfloat16":
                x, y = x.view(torch.bfloat16).float(), y.view(torch.bfloat16).float()
            err = (x - y).abs()
            if level == "raw" or level == {"float32": "never", "bfloat16": "bf16"}[dtype]:
                assert np.array_equal(out, src), f"{level} on {dtype} is not bit-exact"
            elif level in ("fp16", "bf16"):
                rel = 2.0**-11 if level == "fp16" else 2.0**-8
                assert (err <= rel * x.abs() + 2.0**-24 + (2.0**-8 * x.abs() if dtype == "bfloat16" else 0)).all()
            else:
                half = torch.from_numpy(codecs.scales(enc)) / 2  # [L, 2, H, 1, D]
                slack = 1e-5 * x.abs().amax(dim=3, keepdim=True) + (2.0**-8 * y.abs() if dtype == "bfloat16" else 0)
                assert (err <= half + slack).all(), f"{level} on {dtype}: error above the stored scale / 2"
            c.put_chunk(i, out)
        assert not c.missing
        got = m.forward(c, more, all_logits=True)
        assert torch.isfinite(got).all()
        if level == "raw":
            assert torch.equal(c.kv[:, :, :, : cache.length], cache.kv[:, :, :, : cache.length])
            assert torch.equal(got, ref_next)
        elif level in ("fp16", "bf16", "q8"):
            tol = 0.05 * ref_next.abs().max().item()
            assert (got - ref_next).abs().max().item() < tol, f"{level} on {dtype}: continuation drifts"


# ---- the compiled CPU kernels stay on the CPU --------------------------------------------------------
def test_native_attention_kernel_never_sees_device_tensors(f32, monkeypatch):
    """engine/attention.c reads raw host pointers: on CUDA the engine must not hand it device tensors
    (nor build it); on the CPU it may run, with host tensors only."""
    import engine.attention as ea
    import engine.model as em

    m, _ = f32
    calls = []
    real = em.Transformer._attend_native

    def spy(self, layer, q, pos, cache, density):
        tensors = [q, pos, cache.kv] + ([density] if density is not None else [])
        calls.append([t.device.type for t in tensors])
        assert all(t.device.type == "cpu" for t in tensors), "host kernel called with device tensors"
        return real(self, layer, q, pos, cache, density)

    def kernel_spy():
        assert m.device.type == "cpu", "the host attention kernel was looked up for a device model"
        return real_kernel()

    real_kernel = ea.attention_kernel
    monkeypatch.setattr(em.Transformer, "_attend_native", spy)
    monkeypatch.setattr(ea, "attention_kernel", kernel_spy)
    dens = torch.zeros(200, device=m.device)
    cache = m.new_cache(200)
    m.forward(cache, _ids(160, 7), density=dens[:160])  # 160 rows: the native kernel's size on the CPU
    m.forward(cache, [1, 2, 3], density=dens[:163])
    job = m.recompute_start(cache, _ids(163, 7), [0, 1, 2, 3])
    for layer in range(m.cfg.n_layers):
        m.recompute_layer(cache, job, layer)
    if m.device.type != "cpu":
        assert calls == [] and not m.compiled_attention


def test_sampling_on_device_is_seeded(f32):
    from engine.sampling import SamplingParams, sample

    m, _ = f32
    logits = m.forward(m.new_cache(8), _ids(8, 8))
    sp = SamplingParams(temperature=1.3, top_p=0.9, seed=11)
    runs = [[sample(logits, sp, g) for _ in range(5)] for g in (sp.generator(m.device), sp.generator(m.device))]
    assert runs[0] == runs[1]
    assert sample(logits, SamplingParams(), None) == int(logits.argmax())
