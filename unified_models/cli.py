"""Command line: ``unified-models check | convert | inspect``."""

from __future__ import annotations

import argparse
import sys

from .dsl import UnifiedModelsError


def _positive(kind):
    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {s!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {s}")
        return v
    return parse


def _seed(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
    if not 0 <= v < 2**32:
        raise argparse.ArgumentTypeError(f"must be in [0, 2**32), got {v}")
    return v


def _at_least(lo: int):
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="unified-models", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("check", help="rollout with vLLM, recompute with the Megatron module, report the logprob diff")
    c.add_argument("--model", help="HF checkpoint directory (default: build the built-in tiny Nemotron-H)")
    c.add_argument("--preset", default=None, help="built-in preset to build when --model is not given")
    c.add_argument("--prompts", help="JSONL prompt file (default: bundled GSM8K questions)")
    c.add_argument("--tokenizer", help="tokenizer directory (default: the checkpoint's, else the bundled Phi-3 one)")
    c.add_argument("--num-prompts", type=_positive(int), default=16)
    c.add_argument("--max-new-tokens", type=_positive(int), default=128)
    c.add_argument("--seed", type=_seed, default=0, help="request i samples with seed S+i (0 <= S < 2**32 - N)")
    c.add_argument("--temperature", type=_positive(float), default=1.0,
                   help="sampling temperature, applied by the logprob op on both sides (default 1.0)")
    c.add_argument("--stop-at-eos", action="store_true", help="stop sequences at EOS (default: generate exactly --max-new-tokens)")
    c.add_argument("--max-num-seqs", type=_positive(int), default=None, help="vLLM batch limit (default: all prompts at once)")
    c.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    c.add_argument("--peer-tolerance", type=_positive(float), default=1e-4,
                   help="max |logit| difference allowed between our fp32 reference and transformers")
    c.add_argument("--peer-prompts", type=_positive(int), default=2, help="prompts used for the peer check")
    c.add_argument("--full-vocab-rows", type=_at_least(-1), default=-1,
                   help="how many sampled positions compare whole logprob rows (-1 = all)")
    c.add_argument("--json", dest="json_out", help="write the report as JSON here")

    v = sub.add_parser("convert", help="convert between HF safetensors and a Megatron torch_dist checkpoint")
    v.add_argument("--from", dest="src_format", choices=["hf", "megatron"], required=True)
    v.add_argument("--to", dest="dst_format", choices=["hf", "megatron"], required=True)
    v.add_argument("src")
    v.add_argument("dst")
    v.add_argument("--overwrite", action="store_true", help="replace a non-empty DST")

    i = sub.add_parser("inspect", help="print the spec built from a checkpoint's config")
    i.add_argument("model")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "check":
            from .check import CheckOptions, run_check

            if args.model and args.preset:
                raise UnifiedModelsError("--model and --preset are mutually exclusive")
            opts = CheckOptions(**{k: v for k, v in vars(args).items() if k != "command"})
            return run_check(opts)
        if args.command == "convert":
            from .converters.megatron_dist_ckpt import hf_to_megatron, megatron_to_hf

            if args.src_format == args.dst_format:
                raise UnifiedModelsError(f"--from and --to are both {args.src_format!r}")
            fn = hf_to_megatron if args.src_format == "hf" else megatron_to_hf
            out = fn(args.src, args.dst, overwrite=args.overwrite)
            print(f"wrote {out}")
            return 0
        if args.command == "inspect":
            from .converters.hf_safetensors import load_hf_config
            from .models import spec_from_hf_config

            spec = spec_from_hf_config(load_hf_config(args.model))
            print(f"{spec.family} ({spec.architecture}), pattern {spec.extra.get('pattern')}, dtype {spec.dtype}")
            for name, shape in spec.parameter_shapes().items():
                print(f"  {name:60s} {tuple(shape)}")
            return 0
    except UnifiedModelsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
