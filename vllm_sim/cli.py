"""Command line for the simulator: ``python -m vllm_sim`` and ``kvgate sim`` share these flags.

Flag names follow vLLM's where one exists (``--max-num-seqs``, ``--block-size``,
``--max-model-len``, ``--served-model-name`` as an alias of ``--model``).
"""

from __future__ import annotations

import argparse
import sys

from vllm_sim.config import SimConfig
from vllm_sim.faults import Faults
from vllm_sim.timing import TimingModel
from vllm_sim.waiting import POLICIES

__all__ = ["add_arguments", "config_from_args", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    t, f = TimingModel(), Faults()
    d = SimConfig()
    parser.add_argument("--host", default=d.host)
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--model", "--served-model-name", dest="model", action="append", metavar="NAME",
                        help=f"served model name; repeat for several (default {d.model})")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="LoRA adapters served on the model, as vLLM's flag (no weights: only the name and "
                             "path, which go into the adapter's block hashes)")
    parser.add_argument("--name", default=d.name, help="replica name, sent as the x-sim-replica header")
    parser.add_argument("--kv-blocks", "--num-gpu-blocks", dest="kv_blocks", type=int,
                        default=d.num_gpu_blocks, help="KV cache size in blocks")
    parser.add_argument("--block-size", type=int, default=d.block_size)
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len)
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="Hugging Face tokenizer directory with a chat template: tokenize as vLLM would "
                             "(default: the built-in stand-in)")
    parser.add_argument("--embedding-dim", type=int, default=d.embedding_dim)
    parser.add_argument("--seed", type=int, default=d.seed, help="seed for the fault dice")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--prefix-caching-hash-algo", dest="kv_hash", choices=("sim", "sha256_cbor"),
                        default=d.kv_hash, help="block hash; sha256_cbor reproduces vLLM's (seed: PYTHONHASHSEED)")
    parser.add_argument("--hash-seed", default=None, help="NONE_HASH seed in place of PYTHONHASHSEED")
    events = parser.add_argument_group("KV events (vLLM's --kv-events-config, as flags)")
    events.add_argument("--kv-events", default=None, metavar="ENDPOINT", help='PUB endpoint, e.g. "tcp://*:5557"')
    events.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT", help='replay ROUTER, e.g. "tcp://*:5558"')
    events.add_argument("--kv-events-topic", default=d.kv_events_topic)
    events.add_argument("--kv-events-buffer", type=int, default=d.kv_events_buffer, help="batches kept for replay")
    events.add_argument("--kv-events-bytes-hashes", action="store_true",
                        help="32-byte hashes on the wire (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)")
    events.add_argument("--kv-events-legacy", action="store_true", help="events as arrays (vLLM before #42892)")

    timing = parser.add_argument_group("timing")
    timing.add_argument("--time-scale", type=float, default=t.time_scale,
                        help="multiply every duration (0.01 = 100x faster, 0 = no sleeping)")
    timing.add_argument("--max-num-seqs", type=int, default=t.max_num_seqs)
    timing.add_argument("--max-num-batched-tokens", type=int, default=t.max_num_batched_tokens,
                        help="tokens one engine step schedules, long prompts chunked over steps, as vLLM's "
                             "(default: no budget, every prompt whole in one step)")
    timing.add_argument("--scheduling-policy", choices=POLICIES, default=d.scheduling_policy,
                        help="vLLM's: fcfs, or priority (lower 'priority' first, ties by arrival; "
                             "preemption takes the lowest priority)")
    timing.add_argument("--prefill-base-s", type=float, default=t.prefill_base_s)
    timing.add_argument("--prefill-s-per-token", type=float, default=t.prefill_s_per_token)
    timing.add_argument("--decode-base-s", type=float, default=t.decode_base_s)
    timing.add_argument("--decode-s-per-seq", type=float, default=t.decode_s_per_seq)
    timing.add_argument("--kv-transfer-s-per-token", type=float, default=t.kv_transfer_s_per_token,
                        help="P/D: seconds per token a decode replica spends pulling KV from a prefill replica")
    timing.add_argument("--prefill-speed", type=float, default=t.prefill_speed,
                        help="prefill runs at this multiple of the speed the two prefill costs give "
                             "(0.5: half speed, every prefill takes twice as long); decode unchanged")

    pd = parser.add_argument_group("P/D disaggregation (vLLM's --kv-transfer-config with NixlConnector)")
    pd.add_argument("--role", choices=("both", "prefill", "decode"), default=d.role,
                    help="kv_both (default), kv_producer or kv_consumer: which kv_transfer_params it accepts")
    pd.add_argument("--engine-id", default=None, help="kv_transfer_config.engine_id (default: a fresh uuid)")
    pd.add_argument("--side-channel-host", default=None,
                    help="host peers pull from (VLLM_NIXL_SIDE_CHANNEL_HOST; default --host)")
    pd.add_argument("--side-channel-port", type=int, default=None,
                    help="port peers pull from (default --port: the side channel is this HTTP server)")
    pd.add_argument("--kv-lease-s", type=float, default=d.kv_lease_s,
                    help="kv_lease_duration: seconds a prefill keeps blocks for a decode (scaled by --time-scale)")
    pd.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default=d.kv_load_failure_policy,
                    help="a failed pull fails the request (vLLM's default) or is prefilled locally")

    faults = parser.add_argument_group("faults (also settable at run time: POST /sim/faults)")
    faults.add_argument("--error-rate", type=float, default=f.error_rate)
    faults.add_argument("--error-status", type=int, default=f.error_status)
    faults.add_argument("--rate-limit-rate", type=float, default=f.rate_limit_rate)
    faults.add_argument("--stall-before-first-token-s", type=float, default=f.stall_before_first_token_s)
    faults.add_argument("--stall-mid-stream-s", type=float, default=f.stall_mid_stream_s)
    faults.add_argument("--stall-after-tokens", type=int, default=f.stall_after_tokens)
    faults.add_argument("--die-after-tokens", type=int, default=f.die_after_tokens)
    faults.add_argument("--garbage", action="store_true")
    faults.add_argument("--html-200", action="store_true")
    faults.add_argument("--unhealthy", action="store_true")
    faults.add_argument("--kv-events-drop", action="store_true",
                        help="the PUB socket loses every KV event batch (the replay buffer keeps them)")
    faults.add_argument("--kv-events-delay-s", type=float, default=f.kv_events_delay_s,
                        help="send each KV event batch this long after its step ended (events arriving late)")


def _lora_modules(specs: list[str]) -> tuple[tuple[str, str], ...]:
    out = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules: {spec!r} is not NAME=PATH")
        out.append((name, path))
    return tuple(out)


def config_from_args(args: argparse.Namespace) -> SimConfig:
    models = args.model or [SimConfig().model]
    timing = TimingModel(
        prefill_base_s=args.prefill_base_s, prefill_s_per_token=args.prefill_s_per_token,
        decode_base_s=args.decode_base_s, decode_s_per_seq=args.decode_s_per_seq,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        time_scale=args.time_scale, prefill_speed=args.prefill_speed,
        kv_transfer_s_per_token=args.kv_transfer_s_per_token,
    )
    faults = Faults(
        error_rate=args.error_rate, error_status=args.error_status, rate_limit_rate=args.rate_limit_rate,
        stall_before_first_token_s=args.stall_before_first_token_s,
        stall_mid_stream_s=args.stall_mid_stream_s,
        stall_after_tokens=args.stall_after_tokens, die_after_tokens=args.die_after_tokens,
        garbage=args.garbage, html_200=args.html_200, unhealthy=args.unhealthy,
        kv_events_drop=args.kv_events_drop, kv_events_delay_s=args.kv_events_delay_s,
    )
    return SimConfig(
        host=args.host, port=args.port, model=models[0], extra_models=tuple(models[1:]), tokenizer=args.tokenizer,
        lora_modules=_lora_modules(args.lora_modules),
        num_gpu_blocks=args.kv_blocks, block_size=args.block_size, max_model_len=args.max_model_len,
        timing=timing, scheduling_policy=args.scheduling_policy, embedding_dim=args.embedding_dim, faults=faults,
        name=args.name, seed=args.seed,
        kv_hash=args.kv_hash, hash_seed=args.hash_seed, kv_events=args.kv_events,
        kv_events_replay=args.kv_events_replay, kv_events_topic=args.kv_events_topic,
        kv_events_buffer=args.kv_events_buffer, kv_events_int_hashes=not args.kv_events_bytes_hashes,
        kv_events_legacy=args.kv_events_legacy,
        role=args.role, engine_id=args.engine_id, side_channel_host=args.side_channel_host,
        side_channel_port=args.side_channel_port, kv_lease_s=args.kv_lease_s,
        kv_load_failure_policy=args.kv_load_failure_policy,
    )


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; returns a process exit code."""
    import uvicorn

    from vllm_sim.server import build_app

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"vllm_sim: {exc}", file=sys.stderr)
        return 2
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_level=args.log_level,
                access_log=False, timeout_graceful_shutdown=1)
    return 0
