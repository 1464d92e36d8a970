"""The one-process service (`actors.service.wire_local`, no Ray) on CUDA (device from the environment):
the engine's K/V working set lives on the device while chunks travel through host numpy, the codecs
and chunk files. Several contexts are called in turn with greedy decoding, and every way a context
comes back must answer as the unconstrained run does, token for token: resident chunks decoded into
the device working set, swapped chunks read from disk (`swap`, `vllm-s`), killed contexts recomputed
(`lmk`), and a service restarted between two calls of a context. A lossy policy under a tight pool
must simply run.

Skipped when torch sees no CUDA device, so CI on the CPU skips it. `LLMAAS_TEST_DEVICE=cpu` runs the
same checks on the CPU (how this file is debugged without a GPU); the default is `cuda`.

The checkpoint is a small Llama built here from random weights with transformers (as in
tests/engine/test_cuda.py), float32, with head dim 64 and the default model's vocabulary, so that the
default model's tokenizer and chat template drive it. The tokenizer files (tokenizer.json,
tokenizer_config.json, chat_template.jinja) come from the folder `LLMAAS_TEST_TOKENIZER` when set,
else from the default model's converted directory; without either the module is skipped. So on a
machine without the default model's package:

    LLMAAS_TEST_DEVICE=cpu LLMAAS_TEST_TOKENIZER=/path/to/tokenizer-files \\
        python -m pytest tests/actors/test_cuda_service.py -q
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from actors.service import ServiceConfig, wire_local
from engine.config import EngineConfig
from scheduler.pipeline import CostProfile
from storage import codecs
from tests.conftest import SAMPLE_TEXT

DEVICE = os.environ.get("LLMAAS_TEST_DEVICE", "cuda")

pytestmark = pytest.mark.skipif(
    torch.device(DEVICE).type == "cuda" and not torch.cuda.is_available(),
    reason="CUDA checks: torch.cuda.is_available() is False on this machine "
    "(set LLMAAS_TEST_DEVICE=cpu to run them on the CPU)",
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
CFG = dict(
    vocab_size=49152,  # the default model's: its tokenizer drives this checkpoint
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    head_dim=64,  # as the default model
    max_position_embeddings=2048,
    rope_theta=10000.0,
    initializer_range=0.08,  # sharper than the default 0.02: greedy choices are not near-ties
    tie_word_embeddings=True,
)
MAX_CONTEXT = 1024
CHUNK = 16
MAX_TOKENS = 8
N_CTX = 4
# every call switches context but one (index 8: the working set still holds context 1)
ORDER = [0, 1, 2, 3, 2, 0, 3, 1, 1, 3, 0, 2]
RESTART_BEFORE = 5  # context 0's second call comes after a restart
SYSTEM = "You are a concise assistant."
FOLLOW_UPS = ["What is the main topic?", "Give the notes a short title.",
              "Which manual would a C programmer read first?", "In three words: who is the audience?"]
NEAR_TIE = 1e-4
# as measured by `llmaas profile` on a 2-core machine (the planner needs one; this skips measuring)
PROFILE = CostProfile.fit([(1, 0.078), (8, 0.233)], [(3.0e6, 0.018), (14.1e6, 0.032)]).to_json()
LOSSLESS = ["swap", "vllm-s", "lmk"]


def tokenizer_source() -> Path:
    env = os.environ.get("LLMAAS_TEST_TOKENIZER")
    if env:
        d = Path(env)
        missing = [f for f in TOKENIZER_FILES[:2] if not (d / f).is_file()]
        if missing:
            pytest.skip(f"LLMAAS_TEST_TOKENIZER={env} lacks {', '.join(missing)}")
        return d
    try:
        from engine.loader import resolve_model

        return resolve_model(progress=False).directory
    except Exception as e:  # noqa: BLE001 - no package, no gguf reader, ...: nothing to test with
        pytest.skip(f"no tokenizer: LLMAAS_TEST_TOKENIZER is not set and the default model is not "
                    f"available ({type(e).__name__}: {e})")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random-weight Llama with the default model's vocabulary, saved with the tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.chat import ChatTokenizer

    src = tokenizer_source()
    d = tmp_path_factory.mktemp("cuda-service-ckpt")
    for f in TOKENIZER_FILES:
        if (src / f).is_file():
            shutil.copyfile(src / f, d / f)
    tok = ChatTokenizer(d)
    assert tok.vocab_size <= CFG["vocab_size"] and tok.eos_token_id is not None
    bos = tok.tok.bos_token_id
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CFG, eos_token_id=tok.eos_token_id,
                                         bos_token_id=bos if bos is not None else tok.eos_token_id,
                                         pad_token_id=tok.eos_token_id))
    with torch.no_grad():  # random init leaves norms at one; make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.eval().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def dev_engine(checkpoint):
    """The context engine on DEVICE in float32 over the checkpoint."""
    from engine.chat import ChatTokenizer
    from engine.context import ContextEngine
    from engine.model import Transformer

    cfg = EngineConfig(device=DEVICE, dtype="float32", max_context_tokens=MAX_CONTEXT, chunk_tokens=CHUNK)
    model = Transformer.from_directory(checkpoint, cfg)
    assert model.device.type == torch.device(DEVICE).type and model.dtype == torch.float32
    assert model.w.embed.device.type == model.device.type
    return ContextEngine(model, ChatTokenizer(checkpoint), cfg)


def passage(c: int) -> str:
    """A few hundred tokens of English for context `c`: the sample text's sentences, shuffled."""
    sentences = re.split(r"(?<=\.) ", SAMPLE_TEXT)
    rng = random.Random(c)
    parts = []
    for _ in range(3):
        rng.shuffle(sentences)
        parts.append(" ".join(sentences))
    return f"Read these notes (set {c + 1}) and summarise them in one line: " + " ".join(parts)


def prompts() -> list[str]:
    seen, out = set(), []
    for k, c in enumerate(ORDER):
        out.append(FOLLOW_UPS[k % len(FOLLOW_UPS)] if c in seen else passage(c))
        seen.add(c)
    return out


def drive(engine, data_dir: Path, policy: str, pool_bytes: int, restart_before: int | None = None):
    """The calls of ORDER through a one-process service; returns (service, outcomes). The service is
    closed and wired again on the same data directory before call `restart_before`."""
    config = ServiceConfig(data_dir=str(data_dir), policy=policy, pool_bytes=pool_bytes,
                           max_context_tokens=MAX_CONTEXT, chunk_tokens=CHUNK, profile=PROFILE)
    svc = wire_local(config, engine=engine)
    ws = svc.executor.ws
    assert ws.device.type == torch.device(DEVICE).type and ws.dtype == engine.model.dtype
    tok = svc.bind("app")
    ctxs = [svc.new_ctx(tok, SYSTEM) for _ in range(N_CTX)]
    outs = []
    for k, (c, prompt) in enumerate(zip(ORDER, prompts())):
        if k == restart_before:
            svc.close()
            svc = wire_local(config, engine=engine)  # nothing resident: what comes back is from disk
        outs.append(svc.call(tok, ctxs[c], prompt, max_tokens=MAX_TOKENS))
    svc.flush()
    return svc, outs


def switches() -> list[int]:
    """Calls that had to bring their context back (not its first call, not a working-set hit)."""
    return [k for k in range(len(ORDER)) if ORDER[k] in ORDER[:k] and ORDER[k] != ORDER[k - 1]]


def raw_chunk_bytes(engine) -> int:
    m = engine.model.cfg
    return codecs.stored_nbytes("raw", (m.n_layers, 2, m.n_kv_heads, CHUNK, m.head_dim),
                                str(engine.model.dtype).removeprefix("torch."))


@pytest.fixture(scope="module")
def plain(dev_engine):
    """The calls on the plain engine (each context its own cache, nothing ever evicted): the replies
    and the smallest top-2 logit margin of any greedy choice."""
    import engine.context as ec

    margins = []
    real = ec.sample

    def spy(logits, sp, gen):
        top = logits.float().topk(2).values
        margins.append(float(top[0] - top[1]))
        return real(logits, sp, gen)

    ec.sample = spy
    try:
        ctxs = [dev_engine.new_ctx(SYSTEM) for _ in range(N_CTX)]
        outs = [dev_engine.call(ctxs[c], p, max_tokens=MAX_TOKENS).token_ids for c, p in zip(ORDER, prompts())]
        lengths = [x.cache.length for x in ctxs]
        for x in ctxs:
            dev_engine.delete_ctx(x)
    finally:
        ec.sample = real
    return outs, min(margins), lengths


@pytest.fixture(scope="module")
def reference(dev_engine, plain, tmp_path_factory):
    """The unconstrained service run (a pool that never evicts): its replies."""
    svc, outs = drive(dev_engine, tmp_path_factory.mktemp("reference"), "swap", 256 << 20)
    st = svc.governor.stats
    svc.close()
    return outs, st


def test_unconstrained_service_matches_the_plain_engine(plain, reference):
    """The reference: every switch decodes the context's resident chunks into the device working set,
    and the replies are the plain engine's."""
    want, min_margin, lengths = plain
    outs, st = reference
    print(f"{DEVICE}: smallest top-2 margin of a greedy choice {min_margin:.2e}; context lengths {lengths}")
    assert min_margin > NEAR_TIE, (f"the random checkpoint has a near-tie ({min_margin:.1e}) on {DEVICE}: "
                                   "token-for-token checks would be flaky; change the seed")
    assert min(lengths) >= 200  # a few hundred tokens: many chunks to move
    assert st["evictions"] == 0 and st["swap_in_bytes"] == 0
    assert all(outs[k].hit for k in range(len(ORDER)) if k and ORDER[k] == ORDER[k - 1])
    for k in switches():
        r = outs[k].restore
        assert not outs[k].hit and r.resident > 0 and r.loaded == r.recomputed == 0, (k, r)
    assert all(o.token_ids for o in outs)
    assert [o.token_ids for o in outs] == want


def tight_pool(dev_engine, plain) -> int:
    """Room for about one context at raw (never two): every switch brings its context back."""
    _, _, lengths = plain
    return int(1.2 * -(-max(lengths) // CHUNK) * raw_chunk_bytes(dev_engine))


@pytest.mark.parametrize("policy", LOSSLESS)
def test_lossless_policy_under_a_tight_pool_matches_the_reference(policy, dev_engine, plain, reference, tmp_path):
    ref, _ = reference
    svc, outs = drive(dev_engine, tmp_path / policy, policy, tight_pool(dev_engine, plain))
    st = svc.governor.stats
    try:
        assert st["evictions"] > 0
        if policy == "lmk":
            assert st["killed_contexts"] > 0 and st["recomputed_chunks"] > 0
        else:
            assert st["swap_out_bytes"] > 0 and st["swap_in_bytes"] > 0
        for k in switches():  # not vacuous: each switch restored chunks from disk or by recompute
            r = outs[k].restore
            assert not outs[k].hit and r.loaded + r.recomputed > 0, (policy, k, r)
            assert r.faults == 0, (policy, k, r.failed)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    finally:
        svc.close()


def test_restart_between_calls_matches_the_reference(dev_engine, reference, tmp_path):
    """The default policy with a pool that keeps everything raw: closed and wired again between two
    calls of a context, the service reads the chunks back from disk and answers as never restarted."""
    ref, _ = reference
    svc, outs = drive(dev_engine, tmp_path, "llms", 256 << 20, restart_before=RESTART_BEFORE)
    try:
        first = outs[RESTART_BEFORE].restore
        assert not outs[RESTART_BEFORE].hit and first.resident == 0 and first.loaded > 0, first
        for k in switches():
            r = outs[k].restore
            assert r.loaded + r.recomputed + r.resident > 0 and r.faults == 0, (k, r)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        rows = [r for s in svc.parts.registry.list_contexts("app") for r in svc.parts.registry.chunks(s.id)]
        assert rows and {r.level for r in rows} == {"raw"}
    finally:
        svc.close()


def test_lossy_policy_under_a_tight_pool_runs(dev_engine, plain, tmp_path):
    """`llms` with half a context of pool: chunks are lowered (q8/q4/...), swapped and brought back
    into the device working set; the calls complete with replies (not compared: the policy is lossy)."""
    svc, outs = drive(dev_engine, tmp_path, "llms", tight_pool(dev_engine, plain) // 2)
    st = svc.governor.stats
    try:
        assert all(o.token_ids and o.completion_tokens == len(o.token_ids) for o in outs)
        assert st["evictions"] > 0 and st["swap_out_bytes"] > 0
        assert sum(outs[k].restore.loaded + outs[k].restore.recomputed for k in switches()) > 0
        levels = {r.level for s in svc.parts.registry.list_contexts("app") for r in svc.parts.registry.chunks(s.id)}
        print(f"llms on {DEVICE} with a tight pool: stats {dict(st)}, chunk levels {sorted(levels)}")
    finally:
        svc.close()


def test_bfloat16_service_swaps_raw_chunks_exactly(checkpoint, dev_engine, plain, tmp_path):
    """A bfloat16 engine on the device: chunks swapped out and read back at raw (in bfloat16) give the
    replies of the unconstrained bfloat16 run, token for token."""
    from engine.chat import ChatTokenizer
    from engine.context import ContextEngine
    from engine.model import Transformer

    cfg = EngineConfig(device=DEVICE, dtype="bfloat16", max_context_tokens=MAX_CONTEXT, chunk_tokens=CHUNK)
    bf16 = ContextEngine(Transformer.from_directory(checkpoint, cfg), ChatTokenizer(checkpoint), cfg)
    assert bf16.model.dtype == torch.bfloat16
    ref_svc, ref = drive(bf16, tmp_path / "reference", "swap", 256 << 20)
    ref_svc.close()
    svc, outs = drive(bf16, tmp_path / "tight", "swap", tight_pool(bf16, plain))
    try:
        assert svc.governor.stats["swap_in_bytes"] > 0
        assert all(outs[k].restore.loaded > 0 for k in switches())
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    finally:
        svc.close()


def test_cost_profile_is_measured_on_the_device_and_cached_under_it(dev_engine, tmp_path):
    """`llmaas profile` on the device: positive recompute, read and decode costs, cached under a key
    that names the device and dtype (a CPU float32 profile is not reused for it, nor the reverse)."""
    from actors.profiling import ProfileCache, load_or_measure, profile_key

    model = dev_engine.model
    prof = load_or_measure(model, "fp", root=tmp_path, progress=False)
    assert all(sec > 0 for _x, sec in prof.recompute_points) and prof.recompute(8) >= prof.recompute(1) > 0
    assert prof.io(1 << 20) > 0
    print(f"profile on {DEVICE}: recompute points {prof.recompute_points}")
    key = profile_key("fp", torch.get_num_threads(), CHUNK, 0.0, model.device.type, "float32")
    assert ProfileCache(tmp_path).get(key).to_json() == prof.to_json()
    other = "cpu" if model.device.type != "cpu" else "cuda"
    assert ProfileCache(tmp_path).get(profile_key("fp", torch.get_num_threads(), CHUNK, 0.0, other, "float32")) is None


def test_a_prefill_budget_that_only_streaming_fits(dev_engine, tmp_path):
    """A prompt that fits the prefill budget only with its K/V streamed layer by layer: on CUDA the
    working set cannot stream (device memory and pinned host buffers: not built), so the call is
    refused with 413 and its estimate and the context goes on; on the CPU (`LLMAAS_TEST_DEVICE=cpu`)
    it runs streamed and answers as without a budget."""
    from actors.admission import prefill_shape
    from scheduler.prefill import peak_bytes, plan_prefill, streamed_decode_bytes

    prompt = passage(0) + " " + passage(1)
    probe = dev_engine.new_ctx(SYSTEM)
    new = dev_engine.new_tokens(probe, prompt)
    want = dev_engine.call(probe, prompt, max_tokens=MAX_TOKENS).token_ids
    dev_engine.delete_ctx(probe)
    shape = prefill_shape(dev_engine.model, "float")
    budget = max(streamed_decode_bytes(shape, new), peak_bytes(shape, new, 0, 16, severe=True, spill=True)) + (64 << 10)
    assert plan_prefill(shape, new, 0, budget).kind == "severe"
    config = ServiceConfig(data_dir=str(tmp_path), policy="swap", max_context_tokens=MAX_CONTEXT, chunk_tokens=CHUNK,
                           profile=PROFILE, prefill_budget_bytes=budget)
    svc = wire_local(config, engine=dev_engine)
    try:
        tok = svc.bind("app")
        ctx = svc.new_ctx(tok, SYSTEM)
        if torch.device(DEVICE).type == "cuda":
            assert svc.executor.ws.pager is None
            before = svc.describe(tok, ctx)
            with pytest.raises(Exception) as err:
                svc.call(tok, ctx, prompt, max_tokens=MAX_TOKENS)
            assert getattr(err.value, "code", "") == "prompt_too_long" and "cannot" in str(err.value)
            after = svc.describe(tok, ctx)
            assert (after["tokens"], after["turns"]) == (before["tokens"], before["turns"])
        else:
            out = svc.call(tok, ctx, prompt, max_tokens=MAX_TOKENS)
            assert out.prefill_plan == "severe" and out.streamed_bytes > 0 and out.token_ids == want
    finally:
        svc.close()


def test_a_rag_call_from_cached_nodes_on_the_device(dev_engine, tmp_path):
    """actors.rag on the device: the head's and passages' K/V leave the device working set as raw
    records and come back into it; the reply from cached nodes is the whole prefill's."""
    from actors.messages import KVKey, NodeSpan, RagCall
    from actors.rag import node_key, run_rag_call
    from actors.swapio import KVSwapIO
    from engine.rag import RagTemplate

    io = KVSwapIO(str(tmp_path / "chunks"), KVKey("device-test", app="app"))
    pr = RagTemplate(dev_engine.tok).build([dev_engine.tok.encode(passage(i)) for i in range(3)], "What is it about?")
    nodes = [NodeSpan(node_key(io.key, ()), 0, pr.head)] + [
        NodeSpan(node_key(io.key, list(range(i + 1))), a, b) for i, (a, b) in enumerate(pr.spans)]
    ws = dev_engine.model.new_cache(MAX_CONTEXT)

    def call(load, save):
        return run_rag_call(dev_engine, io, RagCall("app", "", pr.ids, load, save, {"max_tokens": MAX_TOKENS}), cache=ws)

    whole = call([], nodes)
    assert ws.kv.device.type == torch.device(DEVICE).type and whole.token_ids
    again = call(nodes[:3], [])
    assert again.token_ids == whole.token_ids and again.reused_tokens == pr.spans[1][1]
