"""Command line: ``unified-models check | rl | report | bisect | gates | convert | quantize | serve | inspect``."""

from __future__ import annotations

import argparse
import signal
import sys

from . import interrupts
from .arg_types import add_plugin_flag, at_least, positive, seed
from .dsl import UnifiedModelsError
from .paths import check_destination, destination_report
from .quantize_options import QUANTIZE_WRITES, modelopt_options
from .serving import serve
from .report import command as report_command


_positive, _seed, _at_least, _add_plugin_flag = positive, seed, at_least, add_plugin_flag


def _plugin_modules(argv: list[str]) -> list[str]:
    """The ``--plugin`` values of ``argv``, wherever they stand (a malformed one is left to the full parser)."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    pre.add_argument("--plugin", action="append", default=[])
    try:
        known, _ = pre.parse_known_args(argv)
    except argparse.ArgumentError:
        return []
    return known.plugin


def _add_trainer_layout_flags(group) -> None:
    """``--ep`` and ``--dp``: the trainer's Megatron layout under torchrun (``check`` and ``rl``)."""
    group.add_argument("--ep", type=_positive(int), default=1,
                       help="trainer expert-parallel size (Megatron's EP groups; divides N and every MoE layer's "
                            "expert count; default 1)")
    group.add_argument("--dp", type=_positive(int), default=None,
                       help="trainer data-parallel size: N at TP = PP = CP = 1 (default N)")


def build_parser() -> argparse.ArgumentParser:
    """The ``unified-models`` parser; build it after :func:`~.plugins.load_plugins` so plugin rewards are choices."""
    p = argparse.ArgumentParser(prog="unified-models", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="rollout with vLLM, recompute with the Megatron module, report the logprob diff")
    c.add_argument("--model", help="HF checkpoint directory (default: build the built-in tiny Nemotron-H)")
    c.add_argument("--preset", default=None, help="built-in preset to build when --model is not given")
    c.add_argument("--prompts", help="JSONL prompt file (default: bundled GSM8K questions)")
    c.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, else the bundled Phi-3 one)")
    c.add_argument("--num-prompts", type=_positive(int), default=16)
    c.add_argument("--max-new-tokens", type=_positive(int), default=128)
    c.add_argument("--seed", type=_seed, default=0, help="request i samples with seed S+i (0 <= S, S + N <= 2**32 for N prompts)")
    c.add_argument("--temperature", type=_positive(float), default=1.0,
                   help="sampling temperature, applied by the logprob op on both sides (default 1.0)")
    c.add_argument("--stop-at-eos", action="store_true", help="stop sequences at EOS (default: generate exactly --max-new-tokens)")
    c.add_argument("--max-num-seqs", type=_positive(int), default=None, help="vLLM batch limit (default: all prompts at once)")
    c.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    c.add_argument("--peer-tolerance", type=_positive(float), default=None,
                   help="max |logit| difference allowed between our fp32 reference and transformers, relative to "
                        "each position's max |logit| (transformers'); default 2**-13 = 1.2e-4, 1024 fp32 ulps")
    c.add_argument("--peer-prompts", type=_positive(int), default=2, help="prompts used for the peer check")
    c.add_argument("--full-vocab-rows", type=_at_least(-1), default=-1,
                   help="how many sampled positions compare whole logprob rows (-1 = all)")
    c.add_argument("--cuda-graphs", type=_on_off, default=None, metavar="{on,off}",
                   help="rollout decode steps in CUDA graphs (default: on for cuda, hybrids included; the CPU "
                        "and rollout expert parallelism run eagerly); the report says which ran")
    cpar = c.add_argument_group(
        "scale-out (under torchrun --nproc-per-node N; docs/scale-out.md)",
        "Under torchrun the recompute's prompts are split over the N ranks (contiguous blocks) and rank 0 "
        "writes one merged report. By default rank 0 alone rolls out (vLLM at DP = 1); with --rollout-dp N "
        "every rank runs its own engine on its block of prompts (request seeds by global prompt index: the "
        "same tokens, logprob bits and rollout sha256 as one process).")
    _add_trainer_layout_flags(cpar)
    cpar.add_argument("--rollout-dp", type=_positive(int), default=None,
                      help="vLLM data_parallel_size: N (one engine per process, vLLM's external launcher) or 1 "
                           "(default: one engine, on rank 0)")
    cpar.add_argument("--rollout-ep", type=_positive(int), default=1,
                      help="1: every engine holds every expert (default); N (with --rollout-dp N): vLLM expert "
                           "parallel, each engine its block of experts")
    c.add_argument("--json", dest="json_out", help="write the report as JSON here")
    _add_plugin_flag(c)

    _add_rl_parser(sub)
    report_command.add_parser(sub)
    from .porting import bisect, gates  # the porting commands (docs/porting.md)
    bisect.add_parser(sub), gates.add_parser(sub)

    v = sub.add_parser("convert", help="convert between HF safetensors and a Megatron torch_dist checkpoint")
    v.add_argument("--from", dest="src_format", choices=["hf", "megatron"], required=True)
    v.add_argument("--to", dest="dst_format", choices=["hf", "megatron"], required=True)
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")
    v.add_argument("--requantize", action="store_true",
                   help="--from megatron: a training checkpoint of a quantized model's masters (rl --save on a "
                        "ModelOpt or block-FP8 checkpoint) is written quantized again under the recipe it was "
                        "trained under (the codes the rollout engine ran), not as its bf16 masters")
    _add_plugin_flag(v)

    q = sub.add_parser("quantize", help=f"export a bf16 checkpoint quantized: {QUANTIZE_WRITES}")
    q.add_argument("src", help="HF checkpoint with model-dtype weights")
    q.add_argument("dst", help="output directory (ModelOpt format: hf_quant_config.json, codes and scales; "
                               "DeepSeek-V4: config.json quantization_config, codes and scales)")
    q.add_argument("--experts", choices=["nvfp4", "none"], default=None,
                   help="Nemotron-H routed experts (W4A16_NVFP4; default nvfp4)")
    q.add_argument("--mamba-proj", choices=["fp8", "none"], default=None,
                   help="Nemotron-H Mamba in/out_proj (FP8 W8A8; default fp8)")
    q.add_argument("--kv-cache", choices=["fp8", "none"], default=None,
                   help="Nemotron-H attention KV cache (FP8 e4m3; default fp8)")
    q.add_argument("--calibration-prompts", help="JSONL prompts for the static FP8 scales (default: bundled GSM8K)")
    q.add_argument("--num-calibration-prompts", type=_positive(int), default=None, help="default 16")
    q.add_argument("--layout", choices=["official", "hf"], default=None,
                   help="DeepSeek-V4 output layout: DeepSeek's published names and float32 .scale (official, "
                        "default) or transformers' names and e8m0 .weight_scale_inv (hf)")
    q.add_argument("--expert-dtype", choices=["fp8", "fp4"], default=None,
                   help="DeepSeek-V4 routed experts: block FP8 (fp8, default; as DeepSeek-V4-Flash-Base) or MXFP4 "
                        "(fp4; as DeepSeek-V4-Flash)")
    q.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, else the bundled Phi-3 one)")
    q.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    _add_plugin_flag(q)

    serve.add_parser(sub)

    i = sub.add_parser("inspect", help="print the spec built from a checkpoint's config")
    i.add_argument("model")
    _add_plugin_flag(i)
    return p


def _non_negative_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def _token_id(s: str):
    if s == "auto":
        return s
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a token id (integer), got {s!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"token ids are >= 0, got {v}")
    return v


def _add_rl_parser(sub) -> None:
    from .rl.rewards import reward_info, reward_names

    r = sub.add_parser(
        "rl", help="GRPO: roll out in vLLM, recompute and compare in Megatron, update, sync weights in place",
        description="GRPO with diff = 0 checked at every step: vLLM rollout -> Megatron recompute and bitwise "
                    "compare -> update -> in-place weight sync. Exits 1 at the first differing logprob.")
    r.add_argument("--model", help="HF checkpoint directory (default: build the built-in tiny Nemotron-H)")
    r.add_argument("--preset", default=None, help="built-in preset to build when --model is not given")
    r.add_argument("--prompts", help="JSONL prompt file (default: the bundled 200 GSM8K test questions)")
    r.add_argument("--tokenizer", help="tokenizer directory, whose files --save's checkpoints carry (default: the "
                                       "model's, else the bundled Phi-3 one); --resume needs the saved run's")
    r.add_argument("--reward", choices=reward_names(), default="target-token",
                   help="; ".join(f"{n}: {reward_info(n).description}" for n in reward_names())
                   + " (default target-token)")
    r.add_argument("--target-token-id", type=_token_id, default="auto",
                   help="token id rewarded by --reward target-token; 'auto' (default) = the token the initial "
                        "policy sampled most often in step 1")
    r.add_argument("--steps", type=_positive(int), default=30, help="optimizer updates in total (default 30)")
    r.add_argument("--group-size", type=_at_least(2), default=8, help="samples per prompt, G (default 8)")
    r.add_argument("--num-prompts-per-step", type=_positive(int), default=4, help="prompts per step, P (default 4)")
    def per_reward(key: str) -> str:  # each reward's default, from its registration (rl.rewards)
        vals = [f"{n} {reward_info(n).defaults[key]:g}" for n in reward_names() if key in reward_info(n).defaults]
        return "default: " + ", ".join(vals)

    r.add_argument("--lr", type=_positive(float), default=None,
                   help=f"Adam learning rate, constant ({per_reward('lr')})")
    r.add_argument("--max-new-tokens", type=_positive(int), default=None,
                   help=f"tokens sampled per completion ({per_reward('max_new_tokens')})")
    r.add_argument("--temperature", type=_positive(float), default=None,
                   help="sampling temperature, applied by the logprob op on both sides (low for the synthetic "
                        "rewards, where a random model's near-uniform policy becomes peaked enough to score; "
                        f"{per_reward('temperature')})")
    r.add_argument("--seed", type=_seed, default=0, help="prompt order and per-request sampling seeds")
    r.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    r.add_argument("--kl-coef", type=_non_negative_float, default=0.0,
                   help="beta of the k3 KL penalty to a frozen copy of the initial weights (default 0: none)")
    r.add_argument("--clip-eps", type=_positive(float), default=0.2, help="PPO ratio clip (inactive at ratio 1)")
    r.add_argument("--clip-grad", type=_non_negative_float, default=1.0,
                   help="clip the global grad norm to this (0: off; default 1.0)")
    r.add_argument("--metrics", default="rl_metrics.jsonl",
                   help="per-step JSONL (default rl_metrics.jsonl); the plot goes next to it as .png")
    r.add_argument("--save", help="write Megatron training checkpoints (model, optimizer, RNG, step; the run's "
                                  "tokenizer files for `convert --from megatron`) here")
    r.add_argument("--save-every", type=_positive(int), default=0,
                   help="checkpoint every K steps (and after the last; default: after the last only)")
    r.add_argument("--resume", help="continue from the latest training checkpoint in DIR up to --steps")
    r.add_argument("--use-rollout-logprobs", action="store_true",
                   help="use the rollout's logprobs as old logprobs (skips the no-grad recompute) once diff = 0 was "
                        "verified by the first step of this process; the update's forward is still compared bitwise")
    r.add_argument("--stop-at-eos", action="store_true",
                   help="stop completions at EOS (default: exactly --max-new-tokens)")
    r.add_argument("--full-vocab-rows", type=_at_least(-1), default=256,
                   help="sampled positions per step compared over the whole vocabulary (-1 = all; default 256)")
    r.add_argument("--micro-batch-tokens", type=_positive(int), default=None,
                   help="THD micro-batch size of the trainer (default 4096 CPU / 32768 GPU); the logprob bits do not "
                        "depend on it, the gradient's fp32 sum over micro-batches does (another size: another "
                        "trajectory, so a resumed run keeps the saved run's)")
    r.add_argument("--gpu-memory-utilization", type=_positive(float), default=0.3,
                   help="share of the GPU's memory vLLM may take (weights, KV cache, Mamba state; default 0.3: "
                        "the trainer in the same process needs the rest for its weights, fp32 main weights, "
                        "Adam moments and activations; GPU only)")
    par = r.add_argument_group("scale-out (under torchrun --nproc-per-node N; docs/scale-out.md)")
    par.add_argument("--tp", type=_positive(int), default=1,
                     help="tensor parallel size: 1 only (a TP all-reduce sums across GPUs in an order the other "
                          "engine does not share; docs/scale-out.md)")
    _add_trainer_layout_flags(par)
    par.add_argument("--rollout-dp", type=_positive(int), default=None,
                     help="vLLM data_parallel_size: one engine per process, so N (default N)")
    par.add_argument("--rollout-ep", type=_positive(int), default=1,
                     help="1: every engine holds every expert (default); N: vLLM expert parallel, each engine "
                          "its block of experts")
    r.add_argument("--no-plot", dest="plot", action="store_false", help="do not write the PNG plot")
    _add_plugin_flag(r)


def _quantize(args) -> int:
    import json
    from pathlib import Path

    from .converters.hf_safetensors import load_hf_config
    from .converters.modelopt import export_modelopt
    from .models import spec_from_hf_config
    from .presets import default_prompts_path
    from .prompts import load_prompt_texts, tokenize_prompts
    from .run_options import tokenizer_dir_for

    try:
        model_type = json.loads((Path(args.src) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        model_type = None  # export_modelopt's loader says what is wrong with the source
    nemotron_flags = {"--experts": args.experts, "--mamba-proj": args.mamba_proj, "--kv-cache": args.kv_cache,
                      "--calibration-prompts": args.calibration_prompts,
                      "--num-calibration-prompts": args.num_calibration_prompts}
    if model_type == "deepseek_v4":
        from .converters.deepseek_fp8 import export_deepseek_fp8

        given = sorted(k for k, v in nemotron_flags.items() if v is not None)
        if given:
            raise UnifiedModelsError(f"quantize: {', '.join(given)} apply to Nemotron-H ModelOpt exports; a "
                                     "DeepSeek-V4 checkpoint is written as DeepSeek's block-FP8 checkpoint "
                                     "(options: --layout, --expert-dtype)")
        out = export_deepseek_fp8(args.src, args.dst, layout=args.layout or "official",
                                  expert_dtype=args.expert_dtype or "fp8", overwrite=args.overwrite)
        print(f"wrote {out}")
        return 0
    if args.layout is not None or args.expert_dtype is not None:
        raise UnifiedModelsError("quantize: --layout and --expert-dtype apply to DeepSeek-V4 block-FP8 exports only")
    spec = modelopt_options(args)
    args.num_calibration_prompts = args.num_calibration_prompts or 16
    none = lambda v: None if v == "none" else v  # noqa: E731
    ids = None
    if args.mamba_proj != "none" or args.kv_cache != "none":
        texts = load_prompt_texts(args.calibration_prompts or default_prompts_path(), args.num_calibration_prompts)
        ids = tokenize_prompts(texts, tokenizer_dir_for(Path(args.src), args.tokenizer), vocab_size=spec.vocab_size)
    out = export_modelopt(args.src, args.dst, experts=none(args.experts), mamba_proj=none(args.mamba_proj),
                          kv_cache=none(args.kv_cache), calibration_token_ids=ids, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0


def _convert_from_megatron(args) -> int:
    """``convert --from megatron --to hf``; says what was written when the checkpoint holds a
    quantized model's masters (the masters in the model dtype, or with ``--requantize`` the
    checkpoint quantized again under the recorded recipe)."""
    from .backends.megatron.dist_ckpt import check_dist_checkpoint, megatron_to_hf

    info = check_dist_checkpoint(args.src)  # metadata only: what the checkpoint holds
    out = megatron_to_hf(args.src, args.dst, overwrite=args.overwrite, requantize=args.requantize)
    print(f"wrote {out}")
    if info.recipe is None:
        return 0
    dtype = str(info.spec.dtype).removeprefix("torch.")
    if args.requantize:
        print(f"note: {out} holds the trained masters of {args.src} quantized again under the recipe they were "
              f"trained under ({info.recipe.describe()}), by the rule of the trainer's forward and the weight "
              "sync, with the recorded static scales; config.json is the recorded quantized one", file=sys.stderr)
    else:
        print(f"note: {out} holds the trained {dtype} masters of {args.src} (config.json without "
              f"quantization_config); they were trained under a quantization recipe ({info.recipe.describe()}), "
              f"kept in the training checkpoint: `unified-models convert --from megatron --to hf --requantize "
              f"{args.src} DST` writes the quantized checkpoint under that recipe", file=sys.stderr)
    return 0


def _check_rl_paths(opts) -> None:
    """``rl --save DIR`` must not be, hold or lie inside ``--model`` (checked before anything is read).

    Raises:
        UnifiedModelsError: naming both paths (:func:`.paths.check_destination`).
    """
    if opts.save and opts.model:
        check_destination(opts.model, opts.save, src_name="--model", dst_name="--save")


def _rl_kept(opts) -> str:
    """After an interrupted ``rl``: the latest training checkpoint under ``--save`` (read from
    its tracker file) and how to continue, or that none was written."""
    from pathlib import Path

    from .backends.megatron.checkpoint import iteration_dir, latest_iteration

    if not opts.save:
        return "no checkpoint written (run without --save)"
    step = latest_iteration(Path(opts.save)) if Path(opts.save).is_dir() else None
    if step is None:
        return f"no checkpoint written yet under --save {opts.save}"
    return (f"latest checkpoint: step {step} ({iteration_dir(opts.save, step)}); continue with "
            f"--resume {opts.save} --save {opts.save}")


def _quiet_megatron() -> None:
    """Silence the import-time notices of Megatron and PyTorch DCP that say nothing about the
    conversion (no Transformer Engine / Apex; DCP's single-process note)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled, unavailable or uninitialized.*")
    warnings.filterwarnings("ignore", message=".*`load_state_dict` is deprecated.*", category=FutureWarning)


def _on_off(text: str) -> bool:
    """``on`` -> True, ``off`` -> False (argparse type)."""
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected 'on' or 'off', got {text!r}")
    return text == "on"


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (0 pass, 1 a failed check or run, 2 refused input)."""
    from .plugins import load_plugins

    argv = sys.argv[1:] if argv is None else list(argv)
    try:  # before the parser: a plugin's rewards become --reward choices
        load_plugins(_plugin_modules(argv))
    except UnifiedModelsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    interrupts.reset()
    previous_sigint = _install_sigint_handler()
    try:
        if args.command == "check":
            from .check import CheckOptions, run_check

            if args.model and args.preset:
                raise UnifiedModelsError("--model and --preset are mutually exclusive")
            # unset flags (None) take CheckOptions' defaults (--peer-tolerance: check.PEER_TOLERANCE)
            opts = CheckOptions(**{k: v for k, v in vars(args).items()
                                   if k not in ("command", "plugin") and v is not None})
            interrupts.on_interrupt(lambda: "no report written")
            return run_check(opts)
        if args.command == "rl":
            from .rl.loop import run_rl
            from .rl.options import RLOptions

            opts = RLOptions(**{k: v for k, v in vars(args).items() if k not in ("command", "plugin")})
            _check_rl_paths(opts)
            interrupts.on_interrupt(lambda: _rl_kept(opts))
            return run_rl(opts)
        if args.command == "convert":
            if args.src_format == args.dst_format:
                raise UnifiedModelsError(f"--from and --to are both {args.src_format!r}")
            if args.requantize and args.src_format != "megatron":
                raise UnifiedModelsError("--requantize applies to --from megatron --to hf (a training checkpoint "
                                         "of a quantized model's masters); to quantize a Hugging Face checkpoint "
                                         "use `unified-models quantize`")
            check_destination(args.src, args.dst)  # before anything is imported or read
            interrupts.on_interrupt(destination_report(args.dst))
            _quiet_megatron()
            if args.src_format == "hf":
                from .backends.megatron.dist_ckpt import hf_to_megatron

                print(f"wrote {hf_to_megatron(args.src, args.dst, overwrite=args.overwrite)}")
                return 0
            return _convert_from_megatron(args)
        if args.command == "quantize":
            check_destination(args.src, args.dst)
            interrupts.on_interrupt(destination_report(args.dst))
            return _quantize(args)
        if args.command in ("bisect", "gates"):
            from .porting import bisect, gates
            return (bisect if args.command == "bisect" else gates).run(args)
        if args.command == "report":
            return report_command.run(args)
        if args.command == "serve":
            return serve.run(args)
        if args.command == "inspect":
            from .converters.hf_safetensors import load_hf_config
            from .dsl import SpecError
            from .models import spec_from_hf_config

            try:
                spec = spec_from_hf_config(load_hf_config(args.model))
            except SpecError as e:
                raise type(e)(f"{args.model}/config.json: {e}") from None
            print(f"{spec.family} ({spec.architecture}), pattern {spec.extra.get('pattern')}, dtype {spec.dtype}")
            dtypes = spec.parameter_dtypes()
            for name, shape in spec.parameter_shapes().items():
                extra = "" if dtypes[name] == spec.dtype else f"  {str(dtypes[name]).removeprefix('torch.')}"
                print(f"  {name:60s} {tuple(shape)}{extra}")
            return 0
    except KeyboardInterrupt:
        return _report_interrupt()
    except UnifiedModelsError as e:
        if interrupts.interrupted():  # e.g. a write that failed because Ctrl-C stopped it
            return _report_interrupt()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException:
        if interrupts.interrupted():  # a library re-raised the KeyboardInterrupt as its own error
            return _report_interrupt()
        raise
    finally:
        _restore_sigint_handler(previous_sigint)
    return 1


def _install_sigint_handler():
    """Install :func:`.interrupts.handle_sigint` for SIGINT; returns the previous handler
    (None where signals cannot be set: not the main thread, or SIGINT is ignored on purpose,
    as for a command started in the background by a non-interactive shell)."""
    try:
        if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
            return None
        return signal.signal(signal.SIGINT, interrupts.handle_sigint)
    except ValueError:
        return None


def _restore_sigint_handler(previous) -> None:
    if previous is not None:
        try:
            signal.signal(signal.SIGINT, previous)
        except ValueError:
            pass


def _report_interrupt() -> int:
    """Print the one interrupt line (:func:`.interrupts.summary`); a further Ctrl-C while it
    is composed is ignored. Returns :data:`.interrupts.EXIT_STATUS` (130)."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        pass
    print(interrupts.summary(), file=sys.stderr, flush=True)
    return interrupts.EXIT_STATUS


if __name__ == "__main__":
    sys.exit(main())
