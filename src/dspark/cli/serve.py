"""Serve a target (+ DSpark draft) over an OpenAI-compatible HTTP API with continuous batching.

The endpoints and JSON of vLLM's OpenAI server: POST /v1/completions, POST /v1/chat/completions
(streaming as server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus). Without
--target/--draft it serves the demo pair shipped with the package. SIGTERM (or Ctrl-C) stops taking
connections, lets the requests in flight finish (at most --drain-timeout seconds) and exits 0; if
the engine fails for good (an exception escaping it: logged with its traceback) the server fails
the requests in flight, shuts down and exits 1. The engine runs in a process of its own
(``dspark.serve.engine_process``), so that its steps never wait for the HTTP side's Python. Needs
the serve extra: pip install "dspark[serve]".
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from ._runtime import (add_draft_candidate_arguments, add_eager_argument, add_kv_cache_arguments, add_parallel_argument,
                       add_runtime_arguments, add_schedule_signal_argument, add_tree_arguments,
                       check_draft_candidate_arguments, kv_cache_options, resolve_pair, runtime)

DEMO_MODEL_NAME = "dspark-demo"
API_KEY_ENV = "DSPARK_API_KEY"  # as vLLM's VLLM_API_KEY


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help="Hugging Face causal LM: a directory or a Hub name (default: the demo pair's target)")
    parser.add_argument("--draft", help="DSpark draft: a directory or a Hub name (default: the demo pair's draft)")
    parser.add_argument("--no-draft", action="store_true",
                        help="serve the target alone (plain decoding, the baseline; default: off)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on (0: a free one, printed)")
    parser.add_argument("--max-batch", "--max-num-seqs", dest="max_batch", type=int, default=16,
                        help="requests per engine round (--max-num-seqs: vLLM's name)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step: the running requests' verify/decode tokens, then chunks of "
                             "arriving prompts in the same forward (default: 2048, at least max-batch x verify length "
                             "+ 1024 for prompts)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="tokens per request, prompt included (default: the target's, at most 4096)")
    parser.add_argument("--max-waiting", type=int, default=4096,
                        help="requests that may wait for a batch row; past that the server answers 429 (a waiting "
                             "request holds only its prompt; vLLM bounds none, and load generators open hundreds)")
    parser.add_argument("--scheduler", choices=("off", "threshold", "sps", "cost"), default="off",
                        help="per request: threshold / sps (the kernels' rules); across the batch: cost (the paper's "
                             "Algorithm 1 with the --cost-table of dspark profile)")
    parser.add_argument("--threshold", type=float, default=0.0,
                        help="threshold scheduler: minimum prefix survival; sps: survival floor")
    parser.add_argument("--cost-table", default=None,
                        help="cost scheduler: the JSON that dspark profile writes (default: none; needed by cost)")
    parser.add_argument("--min-predicted-gain", type=float, default=0.04,
                        help="cost scheduler: trim verification only when predicted goodput beats the full block by this")
    add_schedule_signal_argument(parser)
    add_tree_arguments(parser)
    add_draft_candidate_arguments(parser)
    add_eager_argument(parser)
    add_kv_cache_arguments(parser)
    add_parallel_argument(parser)
    add_runtime_arguments(parser)
    for dest in ("allow_pickle", "quiet"):  # switches: the shared help shows no default for them
        _action(parser, dest).help += " (default: off)"
    parser.add_argument("--served-model-name", default=None,
                        help=f"the name clients pass as model (default: --target, or {DEMO_MODEL_NAME!r})")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template (a file or the template itself) replacing the tokenizer's "
                             "(default: the tokenizer's)")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="let chat requests bring their own chat_template (default: off; a template is code "
                             "the server renders)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="the format of the tool calls that chat requests with tool_choice \"auto\" read out of "
                             "the answer (vLLM's names): hermes (<tool_call>{...}</tool_call>: Hermes, Qwen2.5, "
                             "Qwen3), llama3_json ({\"name\", \"parameters\"} objects: Llama 3.1-3.3), mistral "
                             "([TOOL_CALLS][...]) (default: the chat template's format when it shows one, else hermes)")
    parser.add_argument("--engine-factory", metavar="MODULE:FUNCTION", default=None,
                        help="build the engine in Python (benchmarks, e.g. a random-weight target): FUNCTION(config) "
                             "gets the EngineConfig of these flags and returns an LLMEngine; --target then only "
                             "names the tokenizer (none without it; default: load --target / --draft)")
    parser.add_argument("--api-key", default=None,
                        help=f"require Authorization: Bearer KEY on every /v1 route (401 without it; /health and "
                             f"/metrics stay open); the {API_KEY_ENV} environment variable keeps it out of the process "
                             f"list (default: {API_KEY_ENV}, else none: open)")
    parser.add_argument("--drain-timeout", type=float, default=60.0,
                        help="on SIGTERM, seconds the requests in flight may take before they are aborted")


def _action(parser: argparse.ArgumentParser, dest: str) -> argparse.Action:
    return next(a for a in parser._actions if a.dest == dest)


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from dspark.serve import EngineClient, EngineStartError, create_app
    except ImportError as exc:
        print(f'dspark serve: {exc.name} is not installed; install the serve extra: pip install "dspark[serve]"',
              file=sys.stderr)
        return 2
    try:
        _check(args)
        api_key, args.api_key = _api_key(args.api_key), None  # the engine process gets no secret
        listener = _listen(args.host, args.port)  # before loading: a taken port fails at once
        tokenizer, name = _prepare(args)
    except (ValueError, TypeError, OSError) as exc:
        print(f"dspark serve: {exc}", file=sys.stderr)
        return 2
    _log_to_stderr()
    servers: list = []  # the uvicorn server, once made: the engine may fail before

    def engine_failed(exc: BaseException) -> None:  # on the engine client's reader thread
        print(f"dspark serve: the engine failed ({type(exc).__name__}: {exc}); shutting down", file=sys.stderr,
              flush=True)
        for server in servers:
            server.should_exit = True

    try:  # the engine gets a process of its own (serve.engine_process: no GIL shared with the HTTP side)
        engine = EngineClient(functools.partial(build_engine, args), args.max_waiting, engine_failed)
    except EngineStartError as exc:
        print(f"dspark serve: {exc}", file=sys.stderr)
        return 2
    app = create_app(engine, tokenizer, name, chat_template=args.chat_template,
                     trust_request_chat_template=args.trust_request_chat_template, model_root=args.target,
                     api_key=api_key, tool_call_parser=args.tool_call_parser)
    port = listener.getsockname()[1]
    config = uvicorn.Config(app, host=args.host, port=port, timeout_graceful_shutdown=args.drain_timeout)
    server = uvicorn.Server(config)
    servers.append(server)
    mode = "plain decoding" if not engine.info["drafter"] else f"DSpark, scheduler {args.scheduler}"
    auth = ", /v1 needs the API key" if api_key is not None else ""
    tools = f", tool-call parser {app.state.server.tool_parser.name}"
    print(f"dspark serve: {name!r} ({mode}, max batch {args.max_batch}, max model len {engine.max_model_len}{tools}"
          f"{auth}) on http://{args.host}:{port}", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal it shut down on once it is done; with the default action that
    # would kill the process after a clean drain, so the restored handler ignores it and we exit.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    server.run(sockets=[listener])
    return exit_status(app)


def exit_status(app) -> int:
    """The process's exit status once the server stopped: 1 if the engine failed for good (the
    server shut down because of it), 0 after a clean shutdown (SIGTERM / Ctrl-C)."""
    error = app.state.server.loop.error
    if error is None:
        return 0
    print(f"dspark serve: exiting with status 1: the engine failed: {type(error).__name__}: {error}", file=sys.stderr)
    return 1


def _log_to_stderr() -> None:
    """The ``dspark`` loggers (the engine's and the server's errors, with tracebacks) on stderr; uvicorn
    configures only its own."""
    logger = logging.getLogger("dspark")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def _check(args: argparse.Namespace) -> None:
    from dspark.serve.tools import TOOL_PARSERS  # the serve extra: imported once run() found it

    if args.chat_template is not None and Path(args.chat_template).is_file():
        args.chat_template = Path(args.chat_template).read_text()
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_PARSERS)}, got {args.tool_call_parser!r}")
    if args.max_batch < 1:
        raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.drain_timeout < 0:
        raise ValueError(f"--drain-timeout must be >= 0, got {args.drain_timeout}")
    check_draft_candidate_arguments(args)
    if args.no_draft and args.draft is not None:
        raise ValueError("--no-draft and --draft exclude each other")
    if args.engine_factory is not None:
        if args.draft is not None or args.no_draft:
            raise ValueError("--engine-factory builds the engine: give neither --draft nor --no-draft")
        return


def _api_key(flag: str | None) -> str | None:
    """``--api-key``, else ``$DSPARK_API_KEY`` (unset or empty: no key)."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV) or None
    if key is not None and (key == "" or key != key.strip()):
        where = "--api-key" if flag is not None else API_KEY_ENV
        given = "an empty one" if not key.strip() else "one with whitespace around it (a header cannot carry that)"
        raise ValueError(f"{where} must be a non-empty key without surrounding whitespace, got {given}")
    return key


def _prepare(args: argparse.Namespace):
    """(tokenizer or None, served model name); resolves ``--target`` / ``--draft`` (Hub names, the
    demo pair by default) for ``build_engine``."""
    from dspark.engine import load_tokenizer

    if args.engine_factory is not None:
        tokenizer = load_tokenizer(args.target) if args.target is not None else None
        return tokenizer, args.served_model_name or args.engine_factory
    demo = args.target is None and args.draft is None
    resolve_pair(args, no_draft=args.no_draft)
    if args.no_draft:
        args.draft = None
    if demo:
        args.served_model_name = args.served_model_name or DEMO_MODEL_NAME
    return load_tokenizer(args.target), args.served_model_name or args.target


def build_engine(args: argparse.Namespace):
    """The engine of ``args`` (after ``_prepare``), its CUDA graphs captured: what the engine
    process runs."""
    from dspark.engine import EngineConfig, LLMEngine

    device, dtype = runtime(args)
    config = EngineConfig(max_batch=args.max_batch, max_model_len=args.max_model_len, scheduler=args.scheduler,
                          threshold=args.threshold, device=device, dtype=dtype, cost_table=args.cost_table,
                          min_predicted_gain=args.min_predicted_gain,
                          max_num_batched_tokens=args.max_num_batched_tokens, draft_top_k=args.draft_top_k,
                          tree_budget=args.tree_budget, cuda_graphs=not args.enforce_eager,
                          schedule_signal=args.schedule_signal, tensor_parallel_size=args.tensor_parallel_size,
                          draft_candidates=args.draft_candidates, draft_successors=args.draft_successors,
                          **kv_cache_options(args))
    if args.engine_factory is not None:
        engine = _factory(args.engine_factory)(config)
        if not isinstance(engine, LLMEngine):
            raise TypeError(f"--engine-factory {args.engine_factory} must return an LLMEngine, "
                            f"got {type(engine).__name__}")
    else:
        engine = LLMEngine(args.target, args.draft, config)
    if engine.runner.use_graphs:
        start = time.perf_counter()
        graphs = engine.capture_graphs()
        print(f"dspark serve: captured {graphs} CUDA graphs in {time.perf_counter() - start:.1f} s", file=sys.stderr,
              flush=True)
    return engine


def _factory(spec: str):
    import importlib

    module, _, function = spec.partition(":")
    if not module or not function:
        raise ValueError(f"--engine-factory must be MODULE:FUNCTION, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--engine-factory {spec}: {exc}") from None
    if not callable(factory):
        raise TypeError(f"--engine-factory {spec} is not a function")
    return factory


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so a taken port is a one-line error (uvicorn serves on it)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    return sock
