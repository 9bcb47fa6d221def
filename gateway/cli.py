"""The ``kvgate`` command: serve, demo, sim."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from . import logs
from .settings import ConfigError, load_settings


def _serve(args: argparse.Namespace) -> int:
    from .app import build_app
    from .serve import make_server, run, run_servers

    try:
        settings = load_settings(args.config)
    except ConfigError as e:
        print(f"kvgate: {e}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    app = build_app(settings, config_path=args.config)
    t = settings.timeouts
    opts: dict[str, Any] = {"header_timeout_s": t.header_receive_s, "grace_s": settings.shutdown_grace_s}
    servers = [make_server(app, settings.listen.host, settings.listen.port, **opts)]
    admin = _admin_app(app)
    if admin is not None and settings.admin.enabled:
        servers.append(make_server(admin, settings.admin.host, settings.admin.port, lifespan="off", **opts))
    runtime = app.state.runtime

    def on_signal() -> None:
        runtime.shutting_down = True  # /readyz answers 503 from now on

    run(run_servers(servers, on_signal=on_signal, delay_s=settings.shutdown_delay_s))
    return 0


def _admin_app(app: object) -> object | None:
    try:
        from .admin import build_admin_app
    except ImportError:
        return None
    return build_admin_app(app.state.runtime)  # type: ignore[attr-defined]


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .serve import run

    return run(run_demo(port=args.port, replicas=args.replicas, time_scale=args.time_scale,
                        semantic_cache=not args.no_semantic_cache, admin_port=args.admin_port))


def _sim(args: argparse.Namespace) -> int:
    from vllm_sim.cli import run

    return run(args) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="OpenAI-compatible gateway for vLLM fleets")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the gateway from a YAML config (KVGATE_* variables override it)")
    serve.add_argument("--config", "-c", help="YAML config file (or KVGATE_CONFIG)")
    serve.set_defaults(func=_serve)
    demo = sub.add_parser("demo", help="kvgate in front of simulated vLLM replicas; no Redis, no GPU")
    demo.add_argument("--port", type=int, default=8080, help="public port (a free one if taken; 0: any)")
    demo.add_argument("--admin-port", type=int, default=8081, help="admin and status page (a free one if taken)")
    demo.add_argument("--replicas", type=int, default=3)
    demo.add_argument("--time-scale", type=float, default=0.2, help="simulated GPU time x this factor")
    demo.add_argument("--no-semantic-cache", action="store_true")
    demo.set_defaults(func=_demo)
    sim = sub.add_parser("sim", help="one simulated vLLM replica")
    from vllm_sim.cli import add_arguments

    add_arguments(sim)
    sim.set_defaults(func=_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
