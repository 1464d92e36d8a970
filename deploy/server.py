"""`llmaas serve`: a local Ray (dashboard and Jobs API on 127.0.0.1, token authentication on) with the
context service's Serve application, until Ctrl-C; then Serve and Ray are shut down and no Ray process
is left.

Ray reads `RAY_AUTH_MODE` when it is imported, so this module sets the environment before importing
Ray. The Ray token is kept in the data directory (`ray_auth_token`, mode 0600); `ray job submit` needs
`RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<that file>` and is refused without it.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from dataclasses import fields
from pathlib import Path

from actors.config import ServiceConfig, check_working_set, prepare_data_dir, restart_wait_s
from deploy.settings import ServerConfig, admin_token, private_secret, set_serve_timeouts


def load_config_file(path: str) -> dict:
    """Options from a YAML or JSON file: keys of ServiceConfig and ServerConfig (see `llmaas serve --help`)."""
    text = Path(path).read_text()
    if path.endswith((".yaml", ".yml")):
        import yaml

        data = yaml.safe_load(text) or {}
    else:
        data = json.loads(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of options")
    valid = {f.name for f in fields(ServiceConfig)} | {f.name for f in fields(ServerConfig)}
    unknown = sorted(set(data) - valid)
    if unknown:
        raise ValueError(f"{path}: unknown options {unknown}; valid: {sorted(valid)}")
    return data


def options_from_args(args) -> dict:
    opts: dict = load_config_file(args.config) if args.config else {}
    if args.data_dir:
        opts["data_dir"] = args.data_dir
    opts.setdefault("data_dir", os.environ.get("LLMAAS_DATA_DIR", "./data"))
    opts["data_dir"] = str(Path(opts["data_dir"]).expanduser().resolve())
    if args.policy:
        opts["policy"] = args.policy
    if args.kv_budget is not None:
        opts["pool_bytes"] = args.kv_budget
    if args.model:
        opts["model"] = args.model
    if getattr(args, "weights", None):
        opts["weights"] = args.weights
    if getattr(args, "kv_format", None):
        opts["kv_format"] = args.kv_format
    if getattr(args, "weights_resident", None) is not None:
        opts["weights_resident_bytes"] = args.weights_resident
    if getattr(args, "prefill_budget", None) is not None:
        opts["prefill_budget_bytes"] = args.prefill_budget
    if getattr(args, "adapter_root", None):
        opts["adapter_root"] = str(Path(args.adapter_root).expanduser().resolve())
    from engine.quant import WeightFormat
    from scheduler.policies import get_policy

    WeightFormat.parse(str(opts.get("weights", "fp32")))  # a bad format fails here, listing the valid ones

    get_policy(opts.get("policy", "llms"))  # unknown names fail here, listing the valid ones
    check_working_set(str(opts.get("kv_format", "float")), opts.get("policy", "llms"))
    if int(opts.get("pool_bytes", 1)) <= 0:
        raise ValueError("--kv-budget must be a positive number of bytes")
    return opts


def serve_forever(args) -> int:
    restart_wait_s()  # a bad LLMAAS_RESTART_WAIT_S is refused before anything starts
    opts = options_from_args(args)
    data = Path(opts["data_dir"])
    prepare_data_dir(data)
    ray_token = data / "ray_auth_token"
    private_secret(ray_token, lambda: secrets.token_hex(32))
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(ray_token)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    set_serve_timeouts()
    # `ray job submit -- python ...` runs `python` from the cluster's PATH: make it this environment's
    bindir = str(Path(sys.executable).parent)
    if os.environ.get("PATH", "").split(os.pathsep)[0] != bindir:
        os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
    if "ray" in sys.modules:
        raise RuntimeError("Ray was imported before token authentication was configured")

    from engine.loader import resolve_model

    from engine.weightcache import engine_arrays
    from engine.quant import WeightFormat

    print("llmaas: model: preparing (converted once, then cached)", file=sys.stderr)
    resolved = resolve_model(opts.get("model") or None, progress=True)
    model_cfg, arrays = engine_arrays(resolved.directory, resolved.fingerprint,
                                      WeightFormat.parse(str(opts.get("weights", "fp32"))), progress=True)
    if opts.get("weights_resident_bytes") is not None:
        from engine.weightpager import stage_fragments
        from scheduler.fragments import plan_fragments

        plan = plan_fragments(stage_fragments(arrays, model_cfg.n_layers), int(opts["weights_resident_bytes"]),
                              model_cfg.n_layers + 1)
        print(f"llmaas: streamed weights: {plan.describe()}, in each process that runs the model", file=sys.stderr)
    del arrays

    import ray
    from ray import serve

    from actors.ray_actors import RAY_SYSTEM_CONFIG
    from deploy.serve_app import build

    admin = admin_token(str(data), opts.get("admin_token_file", ""))
    del admin  # created now (0600) so the banner can point at it; the server reads it itself
    print(f"llmaas: starting Ray (dashboard and Jobs API on 127.0.0.1:{args.dashboard_port})", file=sys.stderr)
    ray.init(include_dashboard=True, dashboard_host="127.0.0.1", dashboard_port=args.dashboard_port,
             num_cpus=args.num_cpus, log_to_driver=args.verbose, configure_logging=True,
             logging_level="WARNING" if not args.verbose else "INFO", _system_config=RAY_SYSTEM_CONFIG)
    stop = {"flag": False}

    def on_signal(_sig, _frm):
        stop["flag"] = True

    try:
        t0 = time.monotonic()
        serve.start(http_options={"host": args.host, "port": args.port})
        print("llmaas: starting the service actors and the HTTP application ...", file=sys.stderr)
        serve.run(build(opts), name="llmaas", route_prefix="/")
        url = f"http://{args.host}:{args.port}"
        token_src = ("$LLMAAS_ADMIN_TOKEN" if os.environ.get("LLMAAS_ADMIN_TOKEN")
                     else str(Path(opts.get("admin_token_file") or data / "admin_token")))
        print(f"""
llmaas is serving at {url}  (ready in {time.monotonic() - t0:.0f} s)
  admin token:  {token_src}
  data:         {data}
  OpenAPI:      {url}/docs
  register an app, then talk to a context:
    ADMIN=$(cat {data / 'admin_token'})
    TOKEN=$(curl -s -H "Authorization: Bearer $ADMIN" -H 'Content-Type: application/json' -d '{{"name": "demo"}}' {url}/v1/apps | python3 -c 'import json,sys; print(json.load(sys.stdin)["token"])')
    CTX=$(curl -s -H "Authorization: Bearer $TOKEN" -X POST {url}/v1/contexts | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')
    curl -s -H "Authorization: Bearer $TOKEN" -H 'Content-Type: application/json' -d '{{"prompt": "Hello!"}}' {url}/v1/contexts/$CTX/calls
  Ray jobs:     RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH={ray_token} ray job submit --address http://127.0.0.1:{args.dashboard_port} -- python -m ...
  note: Ray's internal ports (GCS 6379, raylet, object manager) listen on all interfaces; firewall them
        on a shared network (README, "Security").
Ctrl-C stops the server.""", flush=True)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        while not stop["flag"]:
            time.sleep(0.5)
        print("\nllmaas: shutting down ...", file=sys.stderr)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    print("llmaas: stopped", file=sys.stderr)
    return 0
