"""`moetier serve` (an OpenAI-compatible HTTP server) and `moetier chat` (a chat in the terminal)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import socket
import sys

from moetier.cache.policies import DEFAULT_POLICY, LIVE_POLICIES
from moetier.cli.defaults import add_sampling_options, command, count, sampling_args
from moetier.cli.generate import (
    add_engine_options,
    add_partition_option,
    add_precision_options,
    add_prefetch_options,
    add_speculation_options,
    add_substitution_options,
    check_engine_args,
    open_engine,
    precision_config,
    speculation_config,
    substitution_config,
)
from moetier.errors import MoetierError

API_KEY_ENV = "MOETIER_API_KEY"
DEFAULT_MAX_MODEL_LEN = 4096  # a server's KV rows hold this many positions each unless the model's window is less


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port_free(host: str, port: int) -> None:
    """Refuse a port another process holds before the model loads (not a minute later)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise MoetierError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                               hint="choose another --port, or stop what holds it") from None


def engine_config(args: argparse.Namespace) -> dict:
    return dict(policy=args.policy, cache_partition=args.cache_partition, prefetch=args.prefetch,
                predictor=args.predictor,
                predict_distance=args.predict_distance, precision=precision_config(args),
                substitution=substitution_config(args), dense_precision=args.dense_precision,
                speculation=speculation_config(args))


def max_model_len(args: argparse.Namespace) -> int:
    """--max-model-len, or the model's context window up to DEFAULT_MAX_MODEL_LEN (config.json alone)."""
    from moetier.model_info import inspect_model

    context = inspect_model(args.model).spec.max_position_embeddings
    if args.max_model_len is None:
        return min(context, DEFAULT_MAX_MODEL_LEN)
    if args.max_model_len > context:
        raise MoetierError(f"--max-model-len {args.max_model_len} is beyond the model's context window ({context})",
                           hint=f"give at most {context}")
    return args.max_model_len


def kv_reserve(args: argparse.Namespace, rows: int, length: int) -> int:
    import torch

    from moetier.engine.kv_pool import kv_bytes_per_token
    from moetier.model_info import inspect_model
    from moetier.store.format import PRECISION_OF_DTYPE

    info = inspect_model(args.model)
    dtype = next((d for d, p in PRECISION_OF_DTYPE.items() if p == info.precision), torch.bfloat16)  # activations'
    return rows * length * kv_bytes_per_token(info.spec, dtype)


def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    from moetier.config import format_bytes
    from moetier.serve.app import ServeSettings, make_app
    from moetier.serve.draining import DrainingServer
    from moetier.serve.engine_loop import EngineLoop
    from moetier.serve.metrics import Metrics

    check_engine_args(args)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    if not is_loopback(args.host) and api_key is None:
        raise MoetierError(f"serving on {args.host} opens the model to the network; it needs an API key",
                           hint=f"give --api-key or set {API_KEY_ENV}, or bind 127.0.0.1")
    if not 0 < args.port < 65536:
        raise MoetierError(f"--port must be in 1..65535, got {args.port}")
    config = engine_config(args)  # refuses bad options before anything loads
    length = max_model_len(args)
    settings = ServeSettings(args.served_model_name or args.model, length, api_key, args.max_queue,
                             args.max_running, args.max_body_bytes)
    check_port_free(args.host, args.port)
    reserve = kv_reserve(args, args.max_running, length)
    if args.ray is not None:
        return _serve_on_ray(args, settings, dict(config, reserve_bytes=reserve))
    if args.replicas is not None:
        raise MoetierError("--replicas is the number of engine replicas under --ray", hint="add --ray")
    engine = open_engine(args, progress=True, reserve_bytes=reserve, **config)
    metrics = Metrics()
    metrics.cache_bytes.set(engine.executor.reserved_bytes)
    metrics.kv_bytes.set(reserve)
    with engine:
        loop = EngineLoop(engine, args.max_running, length, args.max_prefill_tokens, metrics)
        loop.start()
        print(f"moetier: KV rows {format_bytes(reserve)} ({args.max_running} sequences of {length} tokens)",
              file=sys.stderr)
        print(f"moetier: serving {settings.model_name} at http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM "
              f"finishes the requests in flight, then stops)", file=sys.stderr, flush=True)
        # uvicorn drains on SIGTERM, then raises the signal again under the handler found at start: this one makes
        # that a clean exit (status 0) instead of death by the signal, once the requests in flight are answered
        signal.signal(signal.SIGTERM, lambda *_: None)
        config = uvicorn.Config(make_app(loop, settings), host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.drain_timeout)
        try:
            DrainingServer(config, loop).run()
        finally:
            loop.stop()


def _serve_on_ray(args: argparse.Namespace, settings, config: dict) -> None:
    """The same endpoints over --replicas engine replicas behind Ray Serve's prefix-aware router
    (moetier/serve/ray_serve.py), on a local Ray or the cluster at --ray ADDRESS; Ctrl-C or SIGTERM stops it."""
    import dataclasses
    import importlib.util
    import threading

    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("grpc") is None:
        raise MoetierError("--ray needs Ray Serve, an optional extra", hint="pip install 'moetier[ray]'")
    replicas = args.replicas if args.replicas is not None else 2
    if replicas < 1:
        raise MoetierError(f"--replicas must be at least 1, got {replicas}")
    import ray
    from ray import serve

    from moetier.serve.ray_serve import build

    ray.init(address=None if args.ray == "local" else args.ray, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": args.host, "port": args.port})
    engine = dict(config, expert_memory=args.expert_memory, cache_dir=args.cache_dir,  # (as open_engine gives them)
                  reader_threads=args.reader_threads, device=args.device, kernels=args.kernels,
                  reconvert=getattr(args, "reconvert", False), adapt=getattr(args, "adapt", False),
                  offload=getattr(args, "offload", "all"), variants=getattr(args, "variants", None),
                  cuda_graphs=getattr(args, "cuda_graphs", False))
    if getattr(args, "host_memory", None) is not None:
        from moetier.config import HostMemory

        engine["host_memory"] = HostMemory.parse(args.host_memory)
    serve.run(build(args.model, replicas, engine, dataclasses.asdict(settings), args.max_prefill_tokens),
              name="moetier", route_prefix="/")
    print(f"moetier: serving {settings.model_name} at http://{args.host}:{args.port}/v1 on {replicas} Ray Serve "
          f"replicas (Ctrl-C or SIGTERM stops them)", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def _chat(args: argparse.Namespace) -> None:
    from moetier.cli.chat import run_chat

    check_engine_args(args)
    config = engine_config(args)
    engine = open_engine(args, progress=True, **config)
    with engine:
        run_chat(engine, args.max_tokens, sampling_args(args), args.system)


def add_run_options(p: argparse.ArgumentParser) -> None:
    add_engine_options(p, "30%")
    add_precision_options(p)
    add_substitution_options(p)
    add_speculation_options(p)
    p.add_argument("--policy", default=DEFAULT_POLICY, help=f"expert eviction policy: {', '.join(LIVE_POLICIES)}")
    add_partition_option(p)
    add_prefetch_options(p)


def add_parser(sub) -> None:
    s = command(sub, "serve", "serve the model over an OpenAI-compatible HTTP API (docs/serving.md)")
    add_run_options(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback: --api-key needed)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument("--api-key", help=f"the key clients send as `Authorization: Bearer KEY` (or ${API_KEY_ENV})")
    s.add_argument("--served-model-name", help="the model's name in the API (default: --model as given)")
    s.add_argument("--max-running", type=count(1, 256), default=4, help="sequences decoded together (KV rows)")
    s.add_argument("--max-queue", type=count(0, 100_000), default=64,
                   help="requests waiting beyond the running ones; more are refused with 429 and Retry-After")
    s.add_argument("--max-model-len", type=count(2, 1 << 22), default=None,
                   help=f"positions per KV row: prompt + output, at most (default: the model's context window, up "
                        f"to {DEFAULT_MAX_MODEL_LEN})")
    s.add_argument("--max-prefill-tokens", type=count(1, 1 << 22), default=2048,
                   help="prompt tokens one prefill step packs (a longer prompt runs alone)")
    s.add_argument("--max-body-bytes", type=count(1, 1 << 30), default=4 << 20, help="largest request body")
    s.add_argument("--drain-timeout", type=count(0, 86_400), default=60,
                   help="seconds SIGTERM waits for requests in flight before it stops")
    s.add_argument("--ray", nargs="?", const="local", metavar="ADDRESS",
                   help="serve on Ray Serve (the moetier[ray] extra): --replicas engine replicas, each with its own "
                        "expert cache, behind Ray's prefix-aware router; on a local Ray, or the cluster at ADDRESS")
    s.add_argument("--replicas", type=int, help="engine replicas under --ray (default 2)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (info logs every request)")
    s.set_defaults(func=_serve)

    c = command(sub, "chat", "chat with the model in the terminal (its chat template; /reset, Ctrl-C stops an answer)")
    add_run_options(c)
    c.add_argument("--max-tokens", type=int, default=512, help="new tokens per answer, at most")
    add_sampling_options(c)
    c.add_argument("--system", help="a system message to start every conversation with")
    c.set_defaults(func=_chat)
