"""The ``kvgate`` command: serve, demo, sim, tokenizer, check.

Each command imports what it runs when it runs: the simulator (``vllm_sim``) only
for ``demo`` and ``sim``, whose own options ``vllm_sim.cli`` parses.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from gateway.observe import logs
from gateway.settings import ConfigError, Settings, load_settings
from .worker_info import WorkerInfo


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import build_app
    from .serve import run, run_servers

    try:
        settings = load_settings(args.config, overrides={"workers": args.workers} if args.workers is not None else None)
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level, worker=args.worker_id)
    if args.worker_id is None and settings.workers > 1:
        from .workers import supervise

        return supervise(settings, args.config, settings.workers)
    worker = WorkerInfo(args.worker_id, settings.workers, Path(args.run_dir)) if args.worker_id is not None else None
    app = build_app(settings, config_path=args.config, worker=worker)
    runtime = app.state.runtime

    def on_signal() -> None:
        runtime.shutting_down = True  # /readyz answers 503 from now on

    run(run_servers(_servers(app, settings, worker), on_signal=on_signal, on_stop=runtime.close_queue,
                    delay_s=settings.shutdown_delay_s,
                    parent_pid=os.getppid() if worker is not None else None))
    return 0


def _servers(app: Any, settings: Settings, worker: WorkerInfo | None) -> list[Any]:
    """The public listener, and the admin one. A worker of several binds the public port with
    SO_REUSEPORT; worker 0 alone serves the admin port (one status page, one place an operator
    acts) and passes each change on to the others, which serve the admin API on private sockets."""
    from .serve import make_server, reuse_port_socket

    t = settings.timeouts
    opts: dict[str, Any] = {"header_timeout_s": t.header_receive_s, "grace_s": settings.shutdown_grace_s}
    host, port = settings.listen.host, settings.listen.port
    sock = reuse_port_socket(host, port) if worker is not None else None
    servers = [make_server(app, host, port, sock=sock, **opts)]
    admin = _admin_app(app)
    if admin is None or not settings.admin.enabled:
        return servers
    host, port = settings.admin.host, settings.admin.port
    if worker is None:
        servers.append(make_server(admin, host, port, lifespan="off", **opts))
    elif worker.id == 0:
        from gateway.admin.fanout import FanOut

        fanout = FanOut(admin, worker.peer_admin_sockets(), tenants_shared=settings.redis_url is not None)
        servers.append(make_server(fanout, host, port, lifespan="off", sock=reuse_port_socket(host, port), **opts))
    else:
        path = worker.admin_socket(worker.id)
        path.unlink(missing_ok=True)  # left by a predecessor that died
        servers.append(make_server(admin, host, port, lifespan="off", uds=str(path), **opts))
    return servers


def _admin_app(app: object) -> object | None:
    try:
        from gateway.admin.api import build_admin_app
    except ImportError:
        return None
    return build_admin_app(app.state.runtime)  # type: ignore[attr-defined]


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .serve import run

    return run(run_demo(port=args.port, replicas=args.replicas, time_scale=args.time_scale,
                        semantic_cache=not args.no_semantic_cache, admin_port=args.admin_port,
                        precise=args.precise))


def _sim(args: argparse.Namespace) -> int:
    from vllm_sim.cli import add_arguments, run

    parser = argparse.ArgumentParser(prog="kvgate sim", description="one simulated vLLM replica")
    add_arguments(parser)
    return run(parser.parse_args(args.sim_args)) or 0


def _tokenizer(args: argparse.Namespace) -> int:
    from routing.tokenizer_files import FetchError, describe, fetch

    try:
        names = fetch(args.source, args.dir, revision=args.revision)
        found = describe(args.dir)
    except FetchError as e:
        if args.optional:
            # An init step that must not keep the gateway from starting: it then routes
            # this model approximately, and /readyz and GET /admin/routing say so.
            print(f"kvgate: warning: {e}; kvgate will route this model approximately", file=sys.stderr)
            return 0
        print(f"kvgate: {e}", file=sys.stderr)
        return 1
    model = args.model or args.source
    print(f"kvgate: {len(names)} tokenizer files in {args.dir} ({', '.join(names)}); {found}")
    print(f"routing:\n  tokenizers: {{{model!r}: {str(args.dir)!r}}}   # the name clients send as model")
    return 0


def _check(args: argparse.Namespace) -> int:
    from .check import check_fleet, format_report

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    checks = check_fleet(settings, timeout_s=args.timeout)
    print(format_report(checks))
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="OpenAI-compatible gateway for vLLM fleets")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway from a YAML config (KVGATE_* variables override it)")
    serve.add_argument("--config", "-c", help="YAML config file (or KVGATE_CONFIG)")
    serve.add_argument("--workers", type=int, help="worker processes on the one port (overrides workers:)")
    # Set by the supervisor for the processes it starts; not for people.
    serve.add_argument("--worker-id", type=int, help=argparse.SUPPRESS)
    serve.add_argument("--run-dir", help=argparse.SUPPRESS)
    serve.set_defaults(func=_serve)
    demo = sub.add_parser("demo", help="kvgate in front of simulated vLLM replicas; no Redis, no GPU")
    demo.add_argument("--port", type=int, default=8080, help="public port (a free one if taken; 0: any)")
    demo.add_argument("--admin-port", type=int, default=8081, help="admin and status page (a free one if taken)")
    demo.add_argument("--replicas", type=int, default=3)
    demo.add_argument("--time-scale", type=float, default=0.2, help="simulated GPU time x this factor")
    demo.add_argument("--no-semantic-cache", action="store_true")
    demo.add_argument("--precise", action="store_true",
                      help="replicas publish KV events and tokenize as vLLM does; kvgate routes on the events")
    demo.set_defaults(func=_demo)
    tok = sub.add_parser("tokenizer", help="fetch a model's tokenizer files (no weights) for routing.tokenizers")
    tok.add_argument("source", help="a Hugging Face model id (downloaded) or a model directory (copied from)")
    tok.add_argument("dir", help="where to put them (created if missing)")
    tok.add_argument("--revision", help="a branch, tag or commit of the Hub repository")
    tok.add_argument("--model", help="the model name clients send, for the printed config (default: SOURCE)")
    tok.add_argument("--optional", action="store_true",
                     help="a failed fetch warns and exits 0 (an init step that must not block the gateway)")
    tok.set_defaults(func=_tokenizer)
    check = sub.add_parser("check", help="check each replica of a config for what kvgate needs (exit 1 on a failure)")
    check.add_argument("--config", "-c", help="YAML config file (or KVGATE_CONFIG)")
    check.add_argument("--timeout", type=float, default=5.0, help="seconds per replica request")
    check.set_defaults(func=_check)
    # Its options (and --help) pass through to the simulator's own parser (``_sim``).
    sim = sub.add_parser("sim", help="one simulated vLLM replica (kvgate sim --help for its options)",
                         add_help=False)
    sim.set_defaults(func=_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "sim":
        args.sim_args = rest
    elif rest:
        parser.error("unrecognized arguments: " + " ".join(rest))
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
