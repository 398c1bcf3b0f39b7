"""`flashformer serve MODEL`: serve a model over OpenAI's and Anthropic's APIs (flashformer.serve).

    flashformer serve model.gguf --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -H "Content-Type: application/json" \\
         -d '{"model": "model", "messages": [{"role": "user", "content": "Hi!"}]}'

An encoder (a sentence-transformers or BERT-style folder, a `flashformer finetune
--task retrieval` run) is served for POST /v1/embeddings instead, pooled as its
sentence-transformers files say.

The server's root, http://127.0.0.1:8000/, is a chat page (an encoder's: two texts and
their cosine similarity); `--no-webui` leaves only the API.

`--replicas N` runs N engines on Ray Serve behind the same endpoint, each request sent to the
replica most likely to hold its prompt's prefix in its cache (serve/cluster/, docs/serving.md).

Nothing is compiled before the server listens: a decoder runs natively (model/native.py)
from its first request. The seconds from the process's start to listening are printed and
reported in /metrics (flashformer_start_seconds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flashformer.checkpoints.loading import load_draft_model
from flashformer.cli.arguments import add_cache_type_arguments, add_model_arguments, lora_from_args
from flashformer.formatting import format_bytes
from flashformer.generate.proposers import PROPOSERS
from flashformer.startup import paused_gc
from flashformer.text.reasoning import FORMATS as REASONING_FORMATS
from flashformer.text.tool_calls import PARSERS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--served-model-name", help="the model's id in the API (default: the file or folder name)"
    )
    parser.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="a PEFT LoRA adapter folder served beside MODEL as the model NAME: a request whose `model` "
        "is NAME runs with it, MODEL's name without any (repeat for several; one batch mixes them)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="run eagerly, as with --lora, so that POST /v1/load_lora_adapter can load adapters while "
        "serving (without it and without --lora, the native decoder runs, which runs no adapter)",
    )
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` on every /v1 request")
    parser.add_argument(
        "--no-webui", dest="webui", action="store_false", help="no chat page at / (only the API)"
    )
    parser.add_argument(
        "--max-batch",
        type=int,
        default=16,
        help="sequences decoded together (an encoder: inputs encoded together)",
    )
    parser.add_argument("--kv-blocks", type=int, default=512, help="blocks in the KV cache pool")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    add_cache_type_arguments(parser)
    parser.add_argument("--context", type=int, help="the most tokens of one sequence (default: the model's)")
    parser.add_argument("--max-waiting", type=int, default=256, help="queued sequences before answering 503")
    parser.add_argument("--prefill-chunk", type=int, default=128, help="prompt tokens computed per chunk")
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=128,
        help="prompt tokens computed per step while sequences decode (8x when none does): "
        "smaller shortens the steps (inter-token latency), larger the time to first token",
    )
    parser.add_argument(
        "--no-prefix-cache",
        action="store_true",
        help="compute every prompt whole (by default a prompt's beginning shared with earlier "
        "requests is reused from the KV cache)",
    )
    parser.add_argument(
        "--speculative-config",
        metavar="JSON",
        help='speculative decoding, vLLM\'s names: {"method": "ngram", "num_speculative_tokens": 8, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1, "disable_by_batch_size": 4}, or {"method": '
        '"draft_model", "model": PATH, "quantization": MODE, ...}; methods: '
        + ", ".join(PROPOSERS)
        + " (greedy requests draft)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: torch's; with --replicas: each replica's, default 1)",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="N engine replicas on Ray Serve behind this one endpoint, each request sent to the replica "
        "most likely to hold its prompt's prefix (pip install 'flashformer[cluster]'; docs/serving.md)",
    )
    parser.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --replicas: the Ray cluster to run them on (`ray start --head` prints it; "
        "default: a local one, started and stopped with the server)",
    )
    parser.add_argument(
        "--tool-parser",
        choices=sorted(PARSERS),
        help="the format the model writes tool calls in (default: the one its chat template "
        "teaches; generic for a template without tools)",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_FORMATS),
        help="split a thinking model's <think>...</think> off its answers: reasoning_content in chat "
        "completions, thinking blocks in /v1/messages, reasoning items in /v1/responses",
    )


def main_from_args(args) -> None:
    with paused_gc():  # the server's imports: thousands of objects that all live on (flashformer.startup)
        import torch
        import uvicorn

        from flashformer.adapters import AdapterError, load_peft
        from flashformer.checkpoints.loading import load
        from flashformer.encoders.sentence_embeddings import Pooling, SentenceEncoder, read_pooling
        from flashformer.kernels.machine import process_seconds
        from flashformer.model.models import EncoderModel
        from flashformer.serve.app import create_app
        from flashformer.serve.embeddings import EmbeddingEngine
        from flashformer.serve.engine import Engine
        from flashformer.serve.speculation import SpeculativeConfig

    # checked before the model loads
    speculative = (
        None if args.speculative_config is None else SpeculativeConfig.from_json(args.speculative_config)
    )
    if args.replicas is not None or args.ray_address is not None:
        return serve_replicas(args, speculative)

    if args.threads:
        torch.set_num_threads(args.threads)
    where, pooling = read_pooling(args.model)
    name = args.served_model_name or Path(args.model).name.removesuffix(".gguf")
    adapters = served_adapters(args, name)
    model, tokenizer = load(where, quantize=args.quantize, activations=args.activations)
    if isinstance(model, EncoderModel) and adapters:
        raise SystemExit("--lora: adapters are served for text generation; this model is an encoder")
    for adapter, folder in (adapters or {}).items():  # beside the finished (quantized) base, as load does
        try:
            load_peft(model, folder, adapter)
        except AdapterError as error:  # a bad adapter is refused by name, before anything is served
            raise SystemExit(f"--lora {adapter}={folder}: {error}") from None
    if isinstance(model, EncoderModel):
        encoder = SentenceEncoder(model, tokenizer, pooling or Pooling())
        engine = EmbeddingEngine(encoder, max_batch=args.max_batch, max_waiting=args.max_waiting)
        what = f"sentence embeddings ({encoder.dimension} dimensions, max batch {args.max_batch})"
    else:
        engine = Engine(
            model,
            tokenizer,
            **engine_options(args, speculative),
            draft_model=draft_model(speculative, args),
            native=not args.enable_lora,
        )
        runs = "natively" if engine.runner.native is not None else "eagerly (PyTorch's modules)"
        caches = engine.runner.caches[0]
        what = (
            f"max batch {args.max_batch}, {args.kv_blocks} KV blocks of {args.block_size} tokens "
            f"({caches.k_type} keys, {caches.v_type} values: {format_bytes(engine.runner.kv_bytes)}), run {runs}"
        )
    started = process_seconds()
    if isinstance(engine, Engine):
        engine.start_seconds = started
        if engine.adapters:
            what += f"; LoRA adapters {', '.join(engine.adapters)}"
    app = create_app(
        engine,
        name,
        api_key=args.api_key,
        webui=args.webui,
        tool_parser=args.tool_parser,
        reasoning_parser=args.reasoning_parser,
    )
    print(
        f"serving {name} on http://{args.host}:{args.port}/v1 ({what}; started in {started:.1f} s)",
        flush=True,
    )
    if args.webui:
        print(f"the page: http://{args.host}:{args.port}/", flush=True)
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning"))
    if not run_beside(engine, http):
        raise SystemExit(f"the HTTP server on {args.host}:{args.port} stopped (see the error above)")


def served_adapters(args, name: str) -> dict[str, str] | None:
    """--lora's {name: folder}, each name unlike the base's (a request's `model` says which)."""
    try:
        adapters = lora_from_args(args)
    except ValueError as error:  # a name given twice
        raise SystemExit(str(error)) from None
    if adapters and name in adapters:
        raise SystemExit(f"--lora {name}=...: the adapter's name is the base model's; give it another NAME")
    return adapters


def engine_options(args, speculative) -> dict:
    """The Engine's keywords from the flags (a replica's too), the draft model aside."""
    return dict(
        max_batch=args.max_batch,
        num_blocks=args.kv_blocks,
        block_size=args.block_size,
        context=args.context,
        prefill_chunk=args.prefill_chunk,
        prefill_budget=args.prefill_budget,
        max_waiting=args.max_waiting,
        prefix_cache=not args.no_prefix_cache,
        speculative=speculative,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
    )


def serve_replicas(args, speculative) -> None:
    """--replicas N: the engines on Ray Serve (serve/cluster/launch.py), the only path that
    imports Ray."""
    if args.lora or args.enable_lora:
        raise SystemExit("--lora and --enable-lora are served by one engine; --replicas loads no adapter yet")
    if args.replicas is None:
        raise SystemExit(
            f"--ray-address {args.ray_address} needs --replicas N (how many engines to run there)"
        )
    if args.replicas < 1:
        raise SystemExit(f"--replicas must be at least 1; got {args.replicas}")
    try:
        from flashformer.serve.cluster.launch import serve_replicas as serve_on_ray
    except ModuleNotFoundError as error:
        if error.name != "ray" and not (error.name or "").startswith("ray."):
            raise
        raise SystemExit(
            f"--replicas needs Ray Serve: pip install 'flashformer[cluster]' ({error})"
        ) from None
    serve_on_ray(
        args.model,
        name=args.served_model_name or Path(args.model).name.removesuffix(".gguf"),
        host=args.host,
        port=args.port,
        replicas=args.replicas,
        threads=args.threads or 1,
        load_options={"quantize": args.quantize, "activations": args.activations},
        engine_options=engine_options(args, speculative),
        ray_address=args.ray_address,
        api_key=args.api_key,
        webui=args.webui,
        tool_parser=args.tool_parser,
    )


def run_beside(engine, http) -> bool:
    """The engine's loop on this thread, the one that loaded the model, with the HTTP server in
    another (serve/loop.py says why the step must stay on this thread), until Ctrl-C or SIGTERM
    (True) or the HTTP server ends on its own, as when its port is taken (False)."""
    import signal
    import threading

    def serve_http() -> None:
        try:
            http.run()  # off the main thread uvicorn leaves the signals to us
        finally:
            engine.stop()

    def interrupt(signum, frame) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    web = threading.Thread(target=serve_http, name="flashformer-http", daemon=True)
    web.start()
    interrupted = False
    try:
        engine.run()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGTERM, previous)
        http.should_exit = True
        web.join()
    return interrupted


def draft_model(speculative, args):
    """--speculative-config's draft model, loaded (quantized as it says, else as --quantize), or None."""
    if speculative is None or not PROPOSERS[speculative.method].needs_model:
        return None
    return load_draft_model(speculative.model, speculative.quantization or args.quantize, args.activations)
