"""The `llmaas` command line.

`llmaas serve` runs the HTTP service (Ray Serve) until Ctrl-C. `llmaas generate` runs one prompt through
the engine in this process; `llmaas chat` is an interactive multi-turn conversation on one context, in
this process or, with `--url`, on a running server. `llmaas contexts list|show|delete` manages an app's
contexts on a server. `llmaas bench replay|report` replays a trace against memory policies and reports
the results. Generated text goes to stdout, everything else to stderr, so output can be piped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _openmp_spin() -> None:
    """The in-process OpenMP spin (`actors.config.OPENMP_SPIN`) into this process's environment,
    where libgomp reads it as torch loads it: so only before torch is imported."""
    from actors.config import OPENMP_SPIN, openmp_env

    if "torch" not in sys.modules:
        os.environ.update(openmp_env(OPENMP_SPIN))


def _engine(args):
    _openmp_spin()
    from engine.config import EngineConfig
    from engine.context import ContextEngine

    cfg = EngineConfig(device=args.device, dtype=args.dtype, max_context_tokens=args.max_context,
                       weights=args.weights, kv_format=args.kv_format, weights_resident_bytes=args.weights_resident,
                       lookup_draft=args.lookup_draft)
    t0 = time.perf_counter()
    engine = ContextEngine.load(args.model, cfg)
    if args.verbose:
        print(f"llmaas: model loaded in {time.perf_counter() - t0:.2f} s on {engine.model.device}", file=sys.stderr)
        if engine.model.weight_pager is not None:
            print(f"llmaas: streamed weights: {engine.model.weight_pager.plan.describe()}", file=sys.stderr)
    return engine


def _adapter(args, engine):
    """The LoRA adapter `--adapter` names (a PEFT directory), loaded for this process's contexts; None."""
    if not args.adapter:
        return None
    from pathlib import Path

    from engine.lora import AdapterSet

    d = Path(args.adapter).expanduser().resolve()
    m = engine.model
    return AdapterSet(d.parent, m.cfg, device=m.device, dtype=m.dtype).add("adapter", d.name)


def _sampling(args) -> dict:
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": args.seed,
        "stop": tuple(args.stop or ()),
        **_penalties(args),
    }


def _penalties(args) -> dict:
    return {"frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty,
            "repetition_penalty": args.repetition_penalty}


def _add_penalty_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="divide the logits of tokens already in the context or the reply by R (as vLLM and "
                        "transformers do; 1.1-1.3 stops a small model's greedy loops; default 1: off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0, metavar="F",
                   help="OpenAI's: lower a token's logit by F for each time the reply produced it (default 0)")
    p.add_argument("--presence-penalty", type=float, default=0.0, metavar="P",
                   help="OpenAI's: lower a token's logit by P once the reply produced it (default 0)")


def _check_sampling(args) -> None:
    """Fail on bad sampling arguments before spending seconds on loading the model."""
    from engine.sampling import SamplingParams

    SamplingParams(**_sampling(args))


def write_stream(stream, out=None, err=None) -> None:
    """A reply's text to `out` (stdout) as it comes; a long prompt's prefill progress
    (`engine.context.PrefillProgress`) as one line on `err` (stderr), cleared before the text."""
    from engine.context import PrefillProgress

    out, err = out or sys.stdout, err or sys.stderr
    shown = False
    for item in stream:
        if isinstance(item, PrefillProgress):
            print(f"\rllmaas: prefill {item.layers_done}/{item.layers} layers ({item.tokens} tokens)", end="",
                  file=err, flush=True)
            shown = True
            continue
        if shown:
            print("\r\033[K", end="", file=err, flush=True)
            shown = False
        out.write(item)
        out.flush()


def cmd_generate(args) -> int:
    _check_sampling(args)
    engine = _engine(args)
    adapter = _adapter(args, engine)
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    progress = sys.stderr.isatty()
    if args.chat:
        stream = engine.stream(engine.new_ctx(args.system, adapter=adapter), args.prompt, progress=progress,
                               **_sampling(args))
    else:
        stream = engine.complete(args.prompt, adapter=adapter, progress=progress, **_sampling(args))
    write_stream(stream)
    sys.stdout.write("\n")
    r = stream.result
    if args.verbose and r is not None:
        print(
            f"llmaas: {r.completion_tokens} tokens, finish={r.finish_reason}, ttft {r.ttft_s * 1000:.0f} ms, "
            f"{r.completion_tokens / max(r.total_s - r.ttft_s, 1e-9):.1f} tok/s decode",
            file=sys.stderr,
        )
    return 0


CHAT_HELP = """commands: /reset (new context), /stats (context size and timings), /exit (or Ctrl-D)"""


def _prompts(interactive: bool):
    """User turns from stdin, one per line, until EOF or /exit (blank lines skipped)."""
    while True:
        if interactive:
            print("> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            return
        prompt = line.rstrip("\n")
        if not prompt.strip():
            continue
        if prompt.strip() in ("/exit", "/quit"):
            return
        yield prompt


def _remote(args):
    from deploy.client import Client

    token = args.token or os.environ.get("LLMAAS_TOKEN")
    if not token:
        raise SystemExit("llmaas: error: a server call needs an app token: --token or LLMAAS_TOKEN "
                         "(an admin registers apps: POST /v1/apps)")
    return Client(args.url, token)


def cmd_chat_remote(args) -> int:
    from deploy.client import ServiceError

    client = _remote(args)
    ctx = args.context or client.new_ctx(args.system, adapter=args.adapter)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"llmaas chat on {args.url}, context {ctx}. /exit (or Ctrl-D) ends.", file=sys.stderr)
    elif not args.context:
        print(f"llmaas: context {ctx}", file=sys.stderr)
    for prompt in _prompts(interactive):
        stream = client.stream(ctx, prompt, **{k: v for k, v in _sampling(args).items() if v is not None and v != ()})
        try:
            for delta in stream:
                sys.stdout.write(delta)
                sys.stdout.flush()
        except ServiceError as e:
            print(f"\nllmaas: error: {e.code}: {e.message}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if args.verbose and stream.result is not None:
            print(f"llmaas: switch {stream.result.switch_ms:.1f} ms, {stream.result.usage['completion_tokens']} tokens",
                  file=sys.stderr)
    return 0


def cmd_contexts(args) -> int:
    client = _remote(args)
    if args.action == "list":
        rows = client.contexts()
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for r in rows:
                print(f"{r['id']}  {r['tokens']:6d} tokens  last used {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(r['last_used']))}")
        return 0
    if not args.id:
        raise SystemExit(f"llmaas: error: `contexts {args.action}` needs a context id")
    if args.action == "show":
        info = client.context(args.id)
        if args.json:
            print(json.dumps(info, indent=1))
        else:
            c, ws = info["chunks"], info.get("working_set") or {}
            held = ("" if not ws.get("held") else "; in the working set" + (
                f", layers from {ws['streamed_from_layer']} streamed" if ws.get("streamed_from_layer") is not None else ""))
            print(f"context {info['id']}: {info['tokens']} tokens, {c['total']} chunks "
                  f"(resident {c['resident'] or '-'}, swapped {c['swapped'] or '-'}, to recompute {c['to_recompute']}"
                  f"{held})")
            for t in info["turns"]:
                print(f"[{t['role']}] {t['text']}")
        return 0
    client.delete_ctx(args.id)
    print(f"deleted {args.id}", file=sys.stderr)
    return 0


def cmd_adapters(args) -> int:
    client = _remote(args)
    if args.action == "list":
        rows = client.adapters()
        if args.json:
            print(json.dumps(rows, indent=1))
        else:
            for a in rows:
                print(f"{a['name']}  rank {a['rank']}  {','.join(a['targets'])}  {a['path']}")
        return 0
    if not args.name or (args.action == "add" and not args.path):
        raise SystemExit(f"llmaas: error: `adapters {args.action}` needs NAME" + (" and PATH" if args.action == "add" else ""))
    if args.action == "add":
        a = client.add_adapter(args.name, args.path)
        print(f"loaded {a['name']} ({a['key']}, rank {a['rank']})", file=sys.stderr)
    else:
        client.remove_adapter(args.name)
        print(f"removed {args.name}", file=sys.stderr)
    return 0


KINDS = {".md": "markdown", ".markdown": "markdown", ".html": "html", ".htm": "html"}
"""Document kind by file suffix (`llmaas rag add`); anything else is plain text."""


def _rag_files(paths: list[str]) -> list[Path]:
    """The files named, folders walked for .txt, .md and .html files, in order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in (".txt", ".md", ".markdown",
                                                                                          ".html", ".htm"))
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"llmaas: error: {p}: no such file or folder")
    return out


def cmd_rag(args) -> int:
    client = _remote(args)
    if args.action == "collections":
        rows = client.collections()
        if args.json:
            print(json.dumps(rows, indent=1))
        for c in [] if args.json else rows:
            print(f"{c['id']}  {c['name']}  {c['documents']} documents  {c['chunks']} passages")
        return 0
    col = client.collection(args.collection, create=args.action == "add")
    if args.action == "add":
        from tqdm import tqdm

        files = _rag_files(args.items)
        if not files:
            raise SystemExit("llmaas: error: `rag add` needs files or folders of .txt, .md or .html files")
        added = 0
        for f in tqdm(files, desc=f"adding to {args.collection}", unit="doc", disable=not sys.stderr.isatty()):
            d = client.add_document(col, f.read_text(errors="replace"), name=f.name,
                                    kind=KINDS.get(f.suffix.lower(), "text"))
            added += d["chunks"]
        print(f"{len(files)} documents, {added} passages in {args.collection}", file=sys.stderr)
        return 0
    if not args.items:
        raise SystemExit("llmaas: error: `rag ask` needs a question")
    params = dict(max_tokens=args.max_tokens, **_penalties(args), **({"k": args.k} if args.k else {}))
    if args.json:
        print(json.dumps(client.ask(col, " ".join(args.items), **params), indent=1))
        return 0
    stream = client.ask_stream(col, " ".join(args.items), **params)
    for delta in stream:
        print(delta, end="", flush=True)
    print()
    r = stream.result
    if r is None:
        raise SystemExit("llmaas: error: the server's answer ended before it was complete")
    c = r["cache"]
    blended = (f", {c['tokens_blended']} blended ({c['tokens_recomputed']} recomputed)"
               if c.get("tokens_blended") else "")
    print(f"llmaas: {c['level']}, {c['chunks_reused']} passages and {c['tokens_reused']} tokens reused{blended}, "
          f"{sum(r['latency'].values()) * 1000:.0f} ms", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from deploy.server import serve_forever

    return serve_forever(args)


def cmd_chat(args) -> int:
    if args.url:
        return cmd_chat_remote(args)  # the server checks the sampling arguments
    _check_sampling(args)
    engine = _engine(args)
    adapter = _adapter(args, engine)
    ctx = engine.new_ctx(args.system, adapter=adapter)
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"llmaas chat on {engine.model.device}. {CHAT_HELP}", file=sys.stderr)
    last = None
    for prompt in _prompts(interactive):
        if prompt.strip() == "/reset":
            engine.delete_ctx(ctx)
            ctx = engine.new_ctx(args.system, adapter=adapter)
            print("(new context)", file=sys.stderr)
            continue
        if prompt.strip() == "/stats":
            print(
                f"context {ctx.id}: {len(ctx.token_ids)} tokens, {ctx.cache.n_chunks} chunks, "
                f"{ctx.prefilled_tokens} prefilled in total, {ctx.overflows} overflows"
                + (f"; last reply {last.completion_tokens} tokens, ttft {last.ttft_s * 1000:.0f} ms" if last else ""),
                file=sys.stderr,
            )
            continue
        if prompt.startswith("/"):
            print(f"unknown command {prompt.split()[0]}; {CHAT_HELP}", file=sys.stderr)
            continue
        stream = engine.stream(ctx, prompt, progress=sys.stderr.isatty(), **_sampling(args))
        write_stream(stream)
        sys.stdout.write("\n")
        sys.stdout.flush()
        last = stream.result
    return 0


def cmd_profile(args) -> int:
    """Measure the pipeline cost models on this machine and cache them."""
    from actors.profiling import load_or_measure

    engine = _engine(args)
    prof = load_or_measure(engine.model, engine.fingerprint, read_bytes_per_s=args.throttle_mbps * 1e6, refresh=True)
    print(f"T_re(x) = {prof.recompute.intercept * 1000:.2f} ms + {prof.recompute.slope * 1000:.2f} ms/chunk")
    print(f"T_io(m) = {prof.io.intercept * 1000:.2f} ms + {prof.io.slope * 1e9:.3f} ms/MB "
          f"({1 / max(prof.io.slope, 1e-12) / 1e6:.0f} MB/s read)")
    per = ", ".join(f"{lv} {v * 1000:.3f}" for lv, v in prof.decode.per_level)
    print(f"T_dec = ms per chunk de-quantized into the compute dtype: {per}")
    return 0


def cmd_bench(args) -> int:
    if args.what == "replay":
        from deploy.jobs.replay import main as replay_main

        return replay_main(args.args, prog="llmaas bench replay")
    from bench.report import main as report_main

    return report_main(args.args, prog="llmaas bench report")


WEIGHTS_HELP = ("weight format: fp32 (default: the checkpoint as converted), bf16, int8 (per-row), int4 "
                "(group 32, int8 LM head; a Q4_0/Q4_1 GGUF is repacked as it is), int4-g128 (other group "
                "sizes), ...-hfp32 (float LM head), ...-gptq (int4 calibrated by GPTQ: int4-g128-gptq); converted "
                "once into the model cache")


KV_FORMAT_HELP = ("how contexts' K/V is held in memory: float (default, the compute dtype) or kv8 (keys int8, "
                  "values fp8 e4m3, a scale per token and head: about a quarter of float32's memory, +0.2%% "
                  "perplexity on the default model; not with a lossless policy)")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000 ** 2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000 ** 3, "gib": 1 << 30}


def byte_size(text: str) -> int:
    """A size on the command line: bytes, or a number with a unit (`64MiB`, `64M` = 64 MiB, `1.5GB`)."""
    t = text.strip().lower().replace(" ", "")
    i = len(t)
    while i and not (t[i - 1].isdigit() or t[i - 1] == "."):
        i -= 1
    try:
        value, unit = float(t[:i]), _SIZE_UNITS[t[i:]]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: give bytes, or a number with K, M, G, KiB, "
                                         "MiB, GiB, KB, MB or GB") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a size cannot be negative")
    return int(value * unit)


WEIGHTS_RESIDENT_HELP = ("keep at most SIZE of the weights resident, smallest fragments first (each matrix, norm "
                         "and bias of each block); stream the rest from the mapped weight file per block, the "
                         "next read ahead while one computes (CPU only; default: every weight resident)")


def _kv_formats() -> tuple[str, ...]:
    from engine.config import KV_FORMATS

    return KV_FORMATS


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=os.environ.get("LLMAAS_MODEL"),
                   help="GGUF file or Hugging Face checkpoint directory (Llama, Qwen2); default: the embedded "
                        "SmolLM2-135M-Instruct (env LLMAAS_MODEL)")
    p.add_argument("--device", default="auto", help="torch device: auto (cuda if present, else cpu), cpu, cuda, cuda:1")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (auto: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--weights", default="fp32", metavar="FORMAT", help=WEIGHTS_HELP)
    p.add_argument("--kv-format", default="float", choices=_kv_formats(), help=KV_FORMAT_HELP)
    p.add_argument("--weights-resident", type=byte_size, default=None, metavar="SIZE", help=WEIGHTS_RESIDENT_HELP)
    p.add_argument("--max-context", type=int, default=0, metavar="TOKENS",
                   help="context length before overflow handling (default: the model's maximum)")
    p.add_argument("--lookup-draft", type=int, default=4, metavar="N",
                   help="lookup decoding when greedy: guess up to N next tokens a pass from the context and keep "
                        "what greedy decoding chooses; the reply is unchanged, often sooner (default 4; 0: off)")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most tokens per reply (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1.0)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="sampling seed")
    p.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    _add_penalty_args(p)
    p.add_argument("--system", default=None, metavar="TEXT", help="system prompt (chat)")
    p.add_argument("-v", "--verbose", action="store_true", help="timings on stderr")


def _add_server_args(p: argparse.ArgumentParser, required: bool) -> None:
    default = os.environ.get("LLMAAS_URL") or ("http://127.0.0.1:8000" if required else None)
    p.add_argument("--url", default=default,
                   help="server address" + (" (default $LLMAAS_URL or http://127.0.0.1:8000)" if required
                                            else "; without it the model runs in this process"))
    p.add_argument("--token", default=None, help="the app's bearer token (default $LLMAAS_TOKEN)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmaas",
        description="LLM context service for edge devices: chunked KV cache, compression, swapping, recompute.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    g = sub.add_parser("generate", help="generate text for one prompt, print it to stdout",
                       description="Generate text for one prompt. Only the generated text goes to stdout.")
    g.add_argument("--prompt", required=True, help="the prompt text ('-' reads stdin)")
    g.add_argument("--chat", action="store_true", help="format the prompt as one user turn with the chat template")
    _add_model_args(g)
    g.add_argument("--adapter", default=None, metavar="DIR", help="a LoRA adapter (PEFT directory) to run under")
    g.set_defaults(func=cmd_generate)
    c = sub.add_parser("chat", help="interactive multi-turn chat on one context",
                       description="Interactive multi-turn chat on one context; one line per user turn. " + CHAT_HELP)
    _add_model_args(c)
    _add_server_args(c, required=False)
    c.add_argument("--adapter", default=None, metavar="DIR|NAME",
                   help="a LoRA adapter to run under: its PEFT directory here, or with --url the name of one the "
                        "server loaded (for a new context)")
    c.add_argument("--context", metavar="ID", help="with --url: continue this context (default: a new one)")
    c.set_defaults(func=cmd_chat)
    s = sub.add_parser("serve", help="run the HTTP service (Ray Serve) until Ctrl-C",
                       description="Start a local Ray (dashboard and Jobs API on 127.0.0.1, token authentication "
                                   "on) and the context service's HTTP API; serve until Ctrl-C, then shut "
                                   "everything down. Options also come from --config (YAML or JSON with the keys "
                                   "of actors.service.ServiceConfig and deploy.settings.ServerConfig); flags win.")
    s.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    s.add_argument("--data-dir", default=None, metavar="DIR",
                   help="registry, chunk files and tokens (default $LLMAAS_DATA_DIR or ./data)")
    s.add_argument("--config", default=None, metavar="FILE", help="YAML or JSON options file")
    s.add_argument("--policy", default=None, metavar="NAME",
                   help="memory policy set: llms (default), lmk, swap, vllm-s, vllm-sq, llms-no-* ablations")
    s.add_argument("--kv-budget", type=byte_size, default=None, metavar="SIZE",
                   help="KV pool budget: resident chunks as stored, in bytes or with a unit, 256MiB (the default)")
    s.add_argument("--model", default=os.environ.get("LLMAAS_MODEL"),
                   help="GGUF file or checkpoint directory (default: the embedded SmolLM2-135M-Instruct)")
    s.add_argument("--weights", default=None, metavar="FORMAT", help=WEIGHTS_HELP)
    s.add_argument("--kv-format", default=None, choices=_kv_formats(), help=KV_FORMAT_HELP)
    s.add_argument("--weights-resident", type=byte_size, default=None, metavar="SIZE", help=WEIGHTS_RESIDENT_HELP)
    s.add_argument("--prefill-budget", type=byte_size, default=None, metavar="SIZE",
                   help="memory a call's prefill may take (transient tensors and the context's K/V), estimated "
                        "before it runs: long prompts run in row partitions that fit, or with their K/V streamed "
                        "layer by layer through <data-dir>/ws (the reply's decode too), or answer 413 "
                        "(default: none)")
    s.add_argument("--adapter-root", default=None, metavar="DIR",
                   help="folder LoRA adapters (PEFT directories) are loaded from; nothing outside it is read "
                        "(default <data-dir>/adapters)")
    s.add_argument("--dashboard-port", type=int, default=8265, help="Ray dashboard / Jobs API port (default 8265)")
    s.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray may use (default: all)")
    s.add_argument("-v", "--verbose", action="store_true", help="Ray and actor logs on the console")
    s.set_defaults(func=cmd_serve)
    ct = sub.add_parser("contexts", help="list, show or delete an app's contexts on a server",
                        description="Manage an app's contexts on a running server.")
    ct.add_argument("action", choices=["list", "show", "delete"])
    ct.add_argument("id", nargs="?", help="context id (show, delete)")
    ct.add_argument("--json", action="store_true", help="print JSON")
    _add_server_args(ct, required=True)
    ct.set_defaults(func=cmd_contexts)
    ad = sub.add_parser("adapters", help="list, add or delete a server's LoRA adapters",
                        description="LoRA adapters (PEFT format) on a running server. `add NAME PATH` loads the "
                                    "directory PATH under the server's adapter root as NAME and `delete NAME` "
                                    "unloads it (both with the admin token: --token \"$(cat DATA_DIR/admin_token)\"); "
                                    "`list` takes an app's token too. A context made with an adapter "
                                    "(POST /v1/contexts {\"adapter\": NAME}, or the OpenAI `model` field) is "
                                    "computed under it for its life.")
    ad.add_argument("action", choices=["list", "add", "delete"])
    ad.add_argument("name", nargs="?", help="adapter name (add, delete)")
    ad.add_argument("path", nargs="?", help="its directory under the adapter root (add)")
    ad.add_argument("--json", action="store_true", help="print JSON (list)")
    _add_server_args(ad, required=True)
    ad.set_defaults(func=cmd_adapters)
    rg = sub.add_parser("rag", help="add documents to an app's collection on a server, ask questions over it",
                        description="RAG on a running server: `rag add FILE_OR_FOLDER...` adds .txt, .md and "
                                    ".html files to the collection (made if missing), `rag ask QUESTION...` "
                                    "answers from its passages (or from an earlier answer to a similar "
                                    "question), `rag collections` lists them. Needs an app's token.")
    rg.add_argument("action", choices=["add", "ask", "collections"])
    rg.add_argument("items", nargs="*", help="files or folders (add), the question's words (ask)")
    rg.add_argument("-c", "--collection", default="default", help="collection name (default: default)")
    rg.add_argument("-k", type=int, default=0, help="passages retrieved (default: the server's)")
    rg.add_argument("--max-tokens", type=int, default=128, help="longest answer in tokens (default 128)")
    _add_penalty_args(rg)
    rg.add_argument("--json", action="store_true", help="print JSON")
    _add_server_args(rg, required=True)
    rg.set_defaults(func=cmd_rag)
    pr = sub.add_parser("profile", help="measure recompute and read costs for the restore planner, cache them",
                        description="Measure T_re (recompute x chunks) and T_io (read and decode m bytes of "
                                    "chunk files) on this machine and cache the fitted profile per machine, "
                                    "model and throttle (LLMS §3.3). Services use the cached profile.")
    pr.add_argument("--throttle-mbps", type=float, default=0.0, help="chunk read throttle to profile under (MB/s)")
    _add_model_args(pr)
    pr.set_defaults(func=cmd_profile)
    b = sub.add_parser("bench", help="benchmarks: replay a trace against policies, report the results",
                       description="`llmaas bench replay ...` is `python -m deploy.jobs.replay ...` (replay a "
                                   "context-switching trace against memory policies: per-call CSV, summary JSON); "
                                   "`llmaas bench report RESULTS_DIR [--write docs/benchmarks.md]` is "
                                   "`python -m bench.report ...` (markdown tables, PNG plots). "
                                   "`llmaas bench replay --help` lists the options.")
    b.add_argument("what", choices=["replay", "report"])
    b.add_argument("args", nargs=argparse.REMAINDER, help="that command's options")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from deploy.client import ServiceError  # (no torch: `contexts` and `chat --url` start fast)

    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except ServiceError as e:  # a server's error: its code and message, no traceback
        print(f"llmaas: error: {e.code}: {e.message}", file=sys.stderr)
        return 1
    except (ValueError, OSError) as e:  # bad arguments, unknown names, missing model files
        print(f"llmaas: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
