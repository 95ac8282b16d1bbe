"""Options of ``unified-models rl``: the dataclass, reward-dependent defaults and every
refusal that needs no model (run before any engine starts)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from ..dsl import UnifiedModelsError
from ..run_options import check_output_path
from .rewards import reward_info

__all__ = ["AUTO", "LOOP_DEFAULTS", "RLOptions", "resolve_options", "validate_options", "run_identity"]

AUTO = "auto"
"""``--target-token-id auto``: the token the initial policy sampled most often in step 1."""


@dataclass(kw_only=True)
class RLOptions:
    """Options of ``unified-models rl`` (see ``unified-models rl --help``).

    ``temperature``, ``max_new_tokens`` and ``lr`` default (None) to the
    reward's registered defaults (:mod:`.rewards`), then to the loop's.
    """

    model: str | None = None
    preset: str | None = None
    prompts: str | None = None
    tokenizer: str | None = None
    reward: str = "target-token"
    target_token_id: int | str = AUTO
    steps: int = 30
    group_size: int = 8
    num_prompts_per_step: int = 4
    lr: float | None = None
    max_new_tokens: int | None = None
    temperature: float | None = None
    seed: int = 0
    device: str = "auto"
    kl_coef: float = 0.0
    clip_eps: float = 0.2
    clip_grad: float = 1.0
    metrics: str = "rl_metrics.jsonl"
    save: str | None = None
    save_every: int = 0
    resume: str | None = None
    use_rollout_logprobs: bool = False
    stop_at_eos: bool = False
    full_vocab_rows: int = 256
    micro_batch_tokens: int | None = None
    gpu_memory_utilization: float = 0.3
    tp: int = 1
    ep: int = 1
    dp: int | None = None
    rollout_dp: int | None = None
    rollout_ep: int = 1
    plot: bool = True


LOOP_DEFAULTS = {"temperature": 1.0, "max_new_tokens": 64, "lr": 1e-6}
"""Used where neither the flag nor the reward sets a value."""


def resolve_options(opts: RLOptions) -> RLOptions:
    """A copy of ``opts`` with ``temperature`` / ``max_new_tokens`` / ``lr`` filled from the
    reward's defaults, then :data:`LOOP_DEFAULTS`.

    Raises:
        UnifiedModelsError: the reward is not registered.
    """
    info = reward_info(opts.reward)
    out = RLOptions(**asdict(opts))
    for key, fallback in LOOP_DEFAULTS.items():
        if getattr(out, key) is None:
            setattr(out, key, info.defaults.get(key, fallback))
    return out


def validate_options(opts: RLOptions) -> None:
    """Every refusal that needs no model, before anything starts (``opts`` resolved).

    Raises:
        UnifiedModelsError: naming the flag and the value it refuses.
    """
    if opts.model and opts.preset:
        raise UnifiedModelsError("--model and --preset are mutually exclusive")
    reward_info(opts.reward)
    if opts.group_size < 2:
        raise UnifiedModelsError(f"--group-size {opts.group_size}: GRPO needs at least 2 samples per prompt "
                                 "(the group mean is the baseline)")
    if not opts.temperature > 0:
        raise UnifiedModelsError(f"--temperature must be > 0, got {opts.temperature}")
    if not (opts.lr > 0 and math.isfinite(opts.lr)):
        raise UnifiedModelsError(f"--lr must be a finite number > 0, got {opts.lr}")
    if not 0 < opts.gpu_memory_utilization <= 1:
        raise UnifiedModelsError(f"--gpu-memory-utilization must be in (0, 1], got {opts.gpu_memory_utilization}")
    if opts.kl_coef < 0 or not math.isfinite(opts.kl_coef):
        raise UnifiedModelsError(f"--kl-coef must be >= 0, got {opts.kl_coef}")
    if opts.save_every and not opts.save:
        raise UnifiedModelsError("--save-every needs --save DIR")
    if opts.save_every < 0:
        raise UnifiedModelsError(f"--save-every must be >= 0, got {opts.save_every}")
    if opts.target_token_id != AUTO and opts.reward != "target-token":
        raise UnifiedModelsError(f"--target-token-id applies to --reward target-token, not {opts.reward!r}")
    check_output_path("--metrics", Path(opts.metrics), {"--model": opts.model, "--prompts": opts.prompts,
                                                        "--tokenizer": opts.tokenizer})
    if opts.resume:
        from ..backends.megatron.checkpoint import latest_iteration

        r = Path(opts.resume)
        if not r.is_dir():
            raise UnifiedModelsError(f"--resume {r}: no such directory")
        if latest_iteration(r) is None and not (r / "metadata.json").is_file():
            raise UnifiedModelsError(f"--resume {r}: no training checkpoint there (no "
                                     "latest_checkpointed_iteration.txt); write one with --save")
    if opts.resume and Path(opts.metrics).is_file():  # its steps <= the checkpoint's are kept: read it now
        from .metrics import read_metrics

        try:
            read_metrics(opts.metrics, require_step=True)
        except ValueError as e:
            raise UnifiedModelsError(f"--metrics {e}: a resumed run keeps this file's earlier steps; repair or "
                                     "remove the broken line (a run killed while writing it), or pass another "
                                     "--metrics") from None
    if opts.save:
        from ..backends.megatron.checkpoint import latest_iteration

        s = Path(opts.save)
        if s.exists() and not s.is_dir():
            raise UnifiedModelsError(f"--save {s} is a file")
        have = latest_iteration(s) if s.is_dir() else None
        if have is not None and not (opts.resume and Path(opts.resume).resolve() == s.resolve()):
            raise UnifiedModelsError(f"--save {s} already holds checkpoints (latest step {have}); pass --resume {s} "
                                     "to continue that run, or choose an empty directory")


def run_identity(o: RLOptions) -> dict:
    """What must match for a resumed run to continue the same trajectory (saved in each checkpoint; the
    micro-batch size too: the logprob bits do not depend on it, the gradient's fp32 sum over micro-batches
    does)."""
    return {"reward": o.reward, "seed": o.seed, "group_size": o.group_size,
            "num_prompts_per_step": o.num_prompts_per_step, "temperature": o.temperature,
            "max_new_tokens": o.max_new_tokens, "lr": o.lr, "kl_coef": o.kl_coef, "clip_eps": o.clip_eps,
            "clip_grad": o.clip_grad, "micro_batch_tokens": o.micro_batch_tokens,
            "prompts": str(o.prompts) if o.prompts else None, "stop_at_eos": o.stop_at_eos}
