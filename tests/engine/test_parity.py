"""The engine against Hugging Face transformers on the same de-quantized weights, token for token."""

from __future__ import annotations

import copy

import pytest
import torch

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "List three prime numbers larger than 100.",
    "Translate 'good morning' into Spanish and German.",
    "def fibonacci(n):\n    # complete this Python function",
    "What is 17 multiplied by 23?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What does HTTP status code 404 mean?",
    "Write a SQL query that counts rows in a table named users.",
    "Is a tomato a fruit or a vegetable? Answer briefly.",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Écris une phrase en français sur la mer.",
]
SYSTEMS = [None, "You are a terse assistant. Answer in one sentence."]
NEW_TOKENS = 64
LOGIT_TOL = 1e-3
NEAR_TIE = 1e-4


def machine() -> str:
    """What a numerical miss depends on, for the failure message."""
    return f"torch {torch.__version__}, cpu {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads"


def check_logits(got: torch.Tensor, ref: torch.Tensor, seq: list[int], hf_model, what: str) -> float:
    """Assert the engine's logits `got` are within LOGIT_TOL of transformers' float32 `ref` on `seq`;
    returns the max difference. A miss fails, and its message says which side drifts: both are
    measured against transformers in float64 on the same weights (a CPU that rounds differently moves
    both; a wrong engine or stale weights move only the engine's)."""
    err = (got - ref).abs().max().item()
    if err < LOGIT_TOL:
        return err
    exact_model = copy.deepcopy(hf_model).to(torch.float64).eval()
    with torch.inference_mode():
        exact = exact_model(torch.tensor([seq], device=ref.device)).logits[0]
    e_engine = (got.double() - exact).abs().max().item()
    e_hf = (ref.double() - exact).abs().max().item()
    raise AssertionError(
        f"{what}: max |logit diff| {err:.2e} to transformers float32 (tolerance {LOGIT_TOL:.0e}); to "
        f"float64: engine {e_engine:.2e}, transformers float32 {e_hf:.2e} ({machine()})"
    )


def chat_ids(tok, prompt, system):
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return tok.encode(tok.render(msgs, True))


@pytest.fixture(scope="module")
def hf_continuations(engine, hf_model):
    """transformers' greedy continuation of every prompt (batched, left-padded), ids up to EOS."""
    tok = engine.tok
    seqs = [chat_ids(tok, p, SYSTEMS[i % 2]) for i, p in enumerate(PROMPTS)]
    width = max(map(len, seqs))
    pad = tok.tok.pad_token_id if tok.tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs], device=engine.model.device)
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs], device=engine.model.device)
    with torch.inference_mode():
        out = hf_model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=pad
        )
    result = []
    for s, row in zip(seqs, out[:, width:].tolist()):
        cont = []
        for t in row:
            cont.append(t)
            if t in engine.eos_ids:
                break
        result.append((s, cont))
    return result


def test_teacher_forced_logits_match_transformers(engine, hf_model, hf_continuations):
    """Over prompt + transformers' continuation, engine logits are within 1e-3 of transformers' and the
    argmax agrees at every position (positions whose reference top-2 margin is under 1e-4 are near-ties)."""
    worst = 0.0
    near_ties = []
    for k, (prompt, cont) in enumerate(hf_continuations):
        seq = prompt + cont
        assert len(cont) >= 1
        with torch.inference_mode():
            ref = hf_model(torch.tensor([seq], device=engine.model.device)).logits[0].float()
        got = engine.model.forward(engine.model.new_cache(len(seq)), seq, all_logits=True)
        worst = max(worst, check_logits(got, ref, seq, hf_model, f"prompt {k}"))
        top2 = ref.topk(2, dim=-1).values
        margin = top2[:, 0] - top2[:, 1]
        differ = (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
        for pos in differ:
            assert margin[pos] < NEAR_TIE, f"prompt {k}: argmax differs at position {pos}, margin {margin[pos]:.2e}"
            near_ties.append((k, pos))
    print(f"max |logit diff| over {len(PROMPTS)} prompts: {worst:.2e}; near-ties: {near_ties}")


def test_full_greedy_decoding_matches_transformers(engine, hf_continuations):
    """The engine's own greedy decode (chunked KV, one token at a time) reproduces transformers' greedy
    continuation on at least 3 prompts (all 4 tried here are expected to)."""
    matches = 0
    for prompt, cont in hf_continuations[:4]:
        cache = engine.model.new_cache(len(prompt) + NEW_TOKENS)
        logits = engine.model.forward(cache, prompt)
        out = []
        for _ in range(len(cont)):
            t = int(logits.argmax())
            out.append(t)
            if t in engine.eos_ids:
                break
            logits = engine.model.forward(cache, [t])
        matches += out == cont
    assert matches >= 3, f"only {matches} of 4 greedy continuations matched"


def test_engine_runs_the_directorys_weights(engine, resolved_model, hf_model):
    """The oracle and the engine hold bit-identical weights: the engine's (memory-mapped fused cache)
    equal the converted directory's tensors, which transformers loaded. A parity miss is then about
    arithmetic, never about a stale cache."""
    import numpy as np

    from engine.loader import read_safetensors
    from engine.layout import fuse_hf

    want = fuse_hf(read_safetensors(resolved_model.directory), engine.model.cfg)
    w = engine.model.w
    got = {"embed": w.embed.table, "norm": w.norm}
    for i, layer in enumerate(w.layers):
        for name in ("attn_norm", "mlp_norm"):
            got[f"layers.{i}.{name}"] = getattr(layer, name)
        for name in ("wqkv", "wo", "w_gate_up", "w_down"):
            got[f"layers.{i}.{name}"] = getattr(layer, name).weight
    assert set(got) <= set(want)
    for name, t in got.items():
        assert np.array_equal(t.detach().cpu().float().numpy(), np.asarray(want[name], dtype=np.float32)), name
    hf_embed = hf_model.model.embed_tokens.weight.detach().cpu().numpy()
    assert np.array_equal(hf_embed, w.embed.table.detach().cpu().float().numpy())



PENALIZED = [
    ("repetition", {"repetition_penalty": 1.3}),
    ("frequency and presence", {"frequency_penalty": 0.6, "presence_penalty": 0.4}),
]


@pytest.mark.parametrize("name,penalties", PENALIZED, ids=[n for n, _ in PENALIZED])
def test_penalized_greedy_decoding_matches_transformers(engine, hf_model, name, penalties):
    """Greedy replies under repetition penalties equal transformers' `generate` on the same ids: its own
    `repetition_penalty` (over prompt and reply), and OpenAI's frequency and presence penalties as a
    logits processor written here from OpenAI's formula (over the reply's tokens)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from engine.sampling import SamplingParams

    class OpenAIPenalties(LogitsProcessor):
        def __init__(self, start):
            self.start = start

        def __call__(self, input_ids, scores):
            counts = torch.bincount(input_ids[0, self.start:], minlength=scores.shape[-1]).to(scores.dtype)
            f, p = penalties["frequency_penalty"], penalties["presence_penalty"]
            return scores - counts * f - (counts > 0).to(scores.dtype) * p

    def reply(ids, sp):
        stream = engine.generate(engine.throwaway(ids, n_new), sp)
        for _ in stream:
            pass
        return stream.result.token_ids

    n_new, changed = 24, 0
    for k in (1, 2, 6):
        ids = chat_ids(engine.tok, PROMPTS[k], SYSTEMS[k % 2])
        sp = SamplingParams(max_tokens=n_new, **penalties)
        got = reply(ids, sp)
        kw = ({"repetition_penalty": penalties["repetition_penalty"]} if "repetition_penalty" in penalties
              else {"logits_processor": LogitsProcessorList([OpenAIPenalties(len(ids))])})
        with torch.inference_mode():
            out = hf_model.generate(input_ids=torch.tensor([ids], device=engine.model.device), max_new_tokens=n_new,
                                    do_sample=False, eos_token_id=sorted(engine.eos_ids), **kw)[0, len(ids):].tolist()
        plain = reply(ids, SamplingParams(max_tokens=n_new))
        assert got == out, f"{name}, prompt {k}: engine {got} against transformers {out}"
        changed += got != plain
    assert changed >= 2, f"{name}: the penalties changed {changed} of 3 replies; this would check little"
