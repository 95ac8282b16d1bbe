"""Start of an ``rl`` run: read the checkpoint and prompts once (:func:`load_run`), start
the rollout engine and the trainer and restore ``--resume`` (:func:`start_engines`);
write a training checkpoint (:func:`save_checkpoint`)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
from rich.markup import escape

from ..dsl import PromptError, UnifiedModelsError
from ..run_options import resolve_device, tokenizer_dir_for
from .data import load_prompt_rows
from .distributed import RLLayout, check_layout_for_spec
from .metrics import json_safe
from .options import AUTO, RLOptions, run_identity
from .rewards import build_reward, check_references, reward_info
from .run import RLRun

__all__ = ["load_run", "start_engines", "save_checkpoint", "prompt_ids_sha256", "resume_differences"]


def load_run(opts: RLOptions, layout=None) -> RLRun:
    """Read and validate the checkpoint (``--model`` or the preset) and the prompts, once.

    ``opts`` must be resolved (:func:`.options.resolve_options`); ``layout`` is the run's
    :class:`.distributed.RLLayout` (default: one process). No engine starts here.

    Raises:
        UnifiedModelsError: the checkpoint, a flag that needs the model (``--max-new-tokens``,
            ``--target-token-id``, ``--num-prompts-per-step``, ``--ep`` / ``--rollout-ep``:
            ``ParallelismError``) or the prompts are refused.
    """
    from ..backends.vllm.settings import check_spec_supported
    from ..converters.hf_safetensors import spec_and_state_dict
    from ..presets import DEFAULT_PRESET, build_preset_checkpoint, default_prompts_path
    from ..prompts import tokenize_prompts

    device = resolve_device(opts.device)
    model_dir = Path(opts.model) if opts.model else build_preset_checkpoint(opts.preset or DEFAULT_PRESET)
    _, spec, state_dict = spec_and_state_dict(model_dir)
    check_spec_supported(spec)
    layout = layout or RLLayout()
    check_layout_for_spec(layout, spec)  # an EP that cannot shard this model's experts, before any engine
    if opts.max_new_tokens >= spec.max_position_embeddings:
        raise UnifiedModelsError(f"--max-new-tokens {opts.max_new_tokens} leaves no room for a prompt: the model's "
                                 f"max_position_embeddings is {spec.max_position_embeddings}")
    initial = weights_sha256(state_dict) if opts.kl_coef > 0 else None  # what the KL reference is built from
    if opts.resume:  # a wrong model or nothing left to do: said now, from the checkpoint's metadata files
        step = check_resume(opts, spec)
        check_resume_record(opts, spec, step, initial)
    tid = opts.target_token_id
    if tid != AUTO:
        if not isinstance(tid, int) or not 0 <= tid < spec.vocab_size:
            raise UnifiedModelsError(f"--target-token-id {tid} is outside the model vocabulary [0, {spec.vocab_size})")
    info = reward_info(opts.reward)
    prompts_path = opts.prompts or default_prompts_path()
    rows = load_prompt_rows(prompts_path, need_answer=info.needs_reference)
    check_references(info, rows, prompts_path)  # e.g. a GSM8K answer without '####', named by file:line
    if opts.num_prompts_per_step > len(rows):
        raise UnifiedModelsError(f"--num-prompts-per-step {opts.num_prompts_per_step} exceeds the {len(rows)} "
                                 f"prompts in {prompts_path}")
    # also on --resume: not the checkpoint's hf_assets/ copy (padded to the model's vocabulary, it can tokenize a
    # prompt differently), so a resumed run needs the saved run's --tokenizer
    tok_dir = tokenizer_dir_for(model_dir, opts.tokenizer)
    max_prompt = spec.max_position_embeddings - opts.max_new_tokens
    try:
        prompt_ids = tokenize_prompts([r.text for r in rows], tok_dir, vocab_size=spec.vocab_size,
                                      max_prompt_tokens=max_prompt)
    except PromptError as e:
        raise PromptError(f"{e} (tokenizer: {tok_dir}; pass --tokenizer to use another)") from None
    tokenizer = None
    if info.needs_text:
        from ..prompts import load_tokenizer

        tokenizer = load_tokenizer(tok_dir)
    reward = None if (opts.reward == "target-token" and tid == AUTO) else \
        build_reward(opts.reward, target_token_id=tid if tid != AUTO else None)
    return RLRun(opts=opts, layout=layout, device=device, spec=spec, model_dir=model_dir, prompt_ids=prompt_ids,
                 rows=rows, tokenizer=tokenizer, tokenizer_dir=tok_dir, reward=reward, reward_name=opts.reward,
                 target_token_id=None if tid == AUTO else int(tid), state_dict=state_dict,
                 initial_weights_sha256=initial)


def weights_sha256(state_dict: dict) -> str:
    """SHA-256 (hex) over a checkpoint's tensors: each name, dtype, shape and the SHA-256 of its bytes, in
    name order."""
    from ..converters.megatron_dist_ckpt import tensor_digest

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name]
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{tensor_digest(t)}\n".encode())
    return h.hexdigest()


def check_resume_record(opts, spec, step: int, initial_weights: str | None) -> None:
    """What the ``--resume`` checkpoint's ``rl`` record says must hold before any engine starts.

    * With ``--kl-coef > 0`` the KL reference is the run's initial weights, built from ``--model`` (or the
      preset) again on resume: refused when they are not the saved run's (e.g. ``--model`` a checkpoint
      converted from a later step), which would change every later step's KL term.
    * An existing ``--metrics`` file is appended to: refused when its line of the checkpoint's step is not
      the one the checkpoint recorded (another run's file).

    Raises:
        UnifiedModelsError: naming the mismatch. Checkpoints that record neither are not compared.
    """
    from ..backends.megatron.checkpoint import training_checkpoint_extra

    spec = trained_spec(spec)
    saved = training_checkpoint_extra(opts.resume, spec).get("rl") or {}
    was = saved.get("initial_weights_sha256")
    if initial_weights is not None and isinstance(was, str) and was != initial_weights:
        what = f"--model {opts.model}" if opts.model else f"the preset {opts.preset}'s checkpoint"
        raise UnifiedModelsError(
            f"--resume {opts.resume}: the saved run's KL reference (--kl-coef) is its initial weights, and {what} "
            f"holds other weights (sha256 {initial_weights[:16]} vs {was[:16]}); resume with the saved run's own "
            "--model / --preset (not a checkpoint converted from a later step)")
    if Path(opts.metrics).is_file():
        from .metrics import check_same_run, read_metrics

        rows = [r for r in read_metrics(opts.metrics, require_step=True) if r["step"] <= step]
        try:
            check_same_run(Path(opts.metrics), rows, saved.get("metrics_row"), step)
        except ValueError as e:
            raise UnifiedModelsError(f"--metrics {e}") from None


def trained_spec(spec):
    """The spec of the parameters the trainer trains and checkpoints: the masters' of a quantized
    checkpoint (:func:`unified_models.converters.modelopt.master_spec`), else ``spec`` itself."""
    if not spec.stores_quantized_weights:
        return spec
    from ..converters.modelopt import master_spec

    return master_spec(spec)


def check_resume(opts, spec) -> int:
    """The ``--resume`` checkpoint's step, checked before any engine starts: it must hold the
    parameters the trainer trains (the masters' spec of a quantized checkpoint) and leave steps to do.

    Raises:
        CheckpointError: missing, corrupt, or another model's checkpoint (names the tensors).
        UnifiedModelsError: the checkpoint is already at ``--steps``.
    """
    from ..backends.megatron.checkpoint import check_training_checkpoint

    spec = trained_spec(spec)
    step = check_training_checkpoint(opts.resume, spec)
    if step >= opts.steps:
        raise UnifiedModelsError(f"--resume {opts.resume} is at step {step}; --steps {opts.steps} leaves nothing to do")
    return step


def start_engines(run: RLRun, console) -> int:
    """Start the vLLM engine and the trainer (module, optimizer, frozen reference) on
    ``run.state_dict``, then drop it; restore ``--resume``. Notes go to the rich ``console``.

    Returns:
        The last finished step (0 for a fresh run).

    Raises:
        UnifiedModelsError: the resumed checkpoint does not record the target token that
            ``auto`` chose (its model and step were checked by :func:`check_resume` in :func:`load_run`).
    """
    from ..backends.megatron import destroy_parallel_state
    from ..backends.megatron.optimizer import OptimizerConfig
    from ..backends.megatron.parallel import shard_sequences
    from ..backends.megatron.trainer import Trainer, TrainerOptions
    from ..backends.vllm.rollout import RolloutEngine

    o = run.opts
    # Megatron's groups from an earlier run in this process may sit on a process
    # group vLLM's shutdown has destroyed: drop them; vLLM (re)creates the world.
    destroy_parallel_state()
    lay = run.layout
    longest = max(len(p) for p in run.prompt_ids)
    # sequences per engine: the largest block of GRPO groups a rank gets (all of them in one process)
    s = max(len(shard_sequences(o.num_prompts_per_step, r, lay.world)) for r in range(lay.world)) * o.group_size
    engine_kwargs = {"gpu_memory_utilization": o.gpu_memory_utilization} if run.device == "cuda" else {}
    if lay.distributed:  # one engine per process in torchrun's world (vLLM's external launcher data parallel)
        engine_kwargs.update(data_parallel_size=lay.rollout_dp, enable_expert_parallel=lay.rollout_ep > 1)
    # the engine gets the state dict read once in load_run: vLLM does not read the checkpoint again
    run.engine = RolloutEngine(run.spec, run.model_dir, state_dict=run.state_dict, device=run.device, seed=o.seed,
                               max_model_len=longest + o.max_new_tokens, max_num_seqs=s,
                               max_num_batched_tokens=max(longest + o.max_new_tokens, s * longest), **engine_kwargs)
    # a ModelOpt checkpoint: the trainer trains bf16 masters, quantized on every forward
    run.trainer = Trainer(run.spec, run.state_dict, device=run.device,
                          options=TrainerOptions(optimizer=OptimizerConfig(lr=o.lr, clip_grad=o.clip_grad),
                                                 reference_model=o.kl_coef > 0,  # frozen copy of the initial weights
                                                 micro_batch_tokens=o.micro_batch_tokens,
                                                 expert_model_parallel_size=lay.trainer_ep))
    run.spec = run.trainer.spec
    run.state_dict = None
    start = 0
    if o.resume:
        ck = run.trainer.resume(o.resume)
        start = ck.iteration
        saved = ck.extra.get("rl", {})
        run.saved_metrics_row = saved.get("metrics_row")
        if run.reward_name == "target-token" and run.target_token_id is None:
            if saved.get("target_token_id") is None:
                raise UnifiedModelsError(f"--resume {o.resume}: the checkpoint does not record the target token "
                                         "that 'auto' chose; pass --target-token-id")
            run.target_token_id = int(saved["target_token_id"])
            run.reward = build_reward("target-token", target_token_id=run.target_token_id)
        changed = resume_differences(saved, run)
        if changed:
            console.log(f"[yellow]note[/yellow]: resumed with other settings than the saved run: "
                        + escape(", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())))
        run.sync()  # the engine starts from the checkpoint's weights
    elif run.trainer.trains_masters:
        # dequantize -> requantize is not the identity (scales are recomputed from the
        # rounded masters): give the engine the masters' codes before the first rollout
        rep = run.sync()
        console.log(f"ModelOpt checkpoint: trainer holds bf16 masters; engine re-quantized from them "
                    f"({len(rep.copied)} tensors, {rep.seconds:.1f} s)")
    run.first_step_of_process = start + 1
    return start


def prompt_ids_sha256(prompt_ids: list[list[int]]) -> str:
    """sha256 (hex) of a run's tokenized prompts (``RLRun.prompt_ids``, one list of token ids per prompt
    row, in file order): what ``--prompts`` and ``--tokenizer`` gave the run, saved with each checkpoint."""
    h = hashlib.sha256()
    for ids in prompt_ids:
        h.update(np.asarray(ids, dtype="<i8").tobytes())
        h.update(b"|")
    return h.hexdigest()


def resume_differences(saved: dict, run: RLRun) -> dict[str, tuple]:
    """What a resumed run does differently from the saved run whose checkpoint's ``rl`` record is
    ``saved``: ``{name: (saved value, this run's)}`` for each :func:`.options.run_identity` setting that
    differs; ``"prompt tokens"`` (prompt file and tokenizer directory of each) when the tokenized prompts
    differ (another ``--tokenizer`` or ``--prompts``, or a prompt file edited in place: the path as typed
    is then not compared); ``"target_token_id"`` when ``--target-token-id`` names another token than the
    saved run's; ``"model config.json"`` (the differing keys) when the model's config differs from the
    saved run's although its tensors have the same names and shapes (e.g. another ``rms_norm_eps``).
    Each makes the resumed steps differ from the uninterrupted run's. Keys a checkpoint does not record
    (older checkpoints) are not compared."""
    mine = run_identity(run.opts)
    tokens_saved = "prompt_ids_sha256" in saved
    if tokens_saved:  # the prompt file's tokens are compared below, not its path as typed
        mine.pop("prompts")
    changed = {k: (saved.get(k), v) for k, v in mine.items() if k in saved and saved[k] != v}
    if tokens_saved and saved["prompt_ids_sha256"] != prompt_ids_sha256(run.prompt_ids):
        changed["prompt tokens"] = (f"{saved.get('prompts_file')} tokenized with {saved.get('tokenizer')}",
                                    f"{prompts_file(run)} tokenized with {run.tokenizer_dir}")
    tid = saved.get("target_token_id")
    if run.target_token_id is not None and tid is not None and tid != run.target_token_id:
        changed["target_token_id"] = (tid, run.target_token_id)
    config = saved.get("model_config")
    if isinstance(config, dict):
        now = model_config(run)
        keys = sorted(k for k in (set(config) | set(now)) - UNCOMPARED_CONFIG_KEYS if config.get(k) != now.get(k))
        if keys:
            changed["model config.json"] = tuple(", ".join(f"{k}={c.get(k)!r}" for k in keys) for c in (config, now))
    return changed


UNCOMPARED_CONFIG_KEYS = frozenset({"transformers_version", "_name_or_path"})
"""``config.json`` keys that do not describe the model (the writer's version, a load path)."""


def prompts_file(run: RLRun) -> str:
    """The prompt file ``run`` reads (``--prompts``, else the bundled one), as an absolute path."""
    from ..presets import default_prompts_path

    return str(Path(run.opts.prompts or default_prompts_path()).resolve())


def model_config(run: RLRun) -> dict:
    """``run``'s model ``config.json`` (``--model`` or the preset's) as a dict."""
    return json.loads((run.model_dir / "config.json").read_text())


def save_checkpoint(run: RLRun, step: int, metrics_row: dict | None = None) -> Path:
    """Write the trainer's checkpoint of ``step`` under ``--save`` with the run's identity
    (:func:`.options.run_identity`, the target token) and ``metrics_row``, the step's metrics line as of
    before the save (a ``--resume`` whose metrics file lacks it, the run having stopped between the
    checkpoint and the line, restores it: :class:`.metrics.MetricsWriter`); returns its directory.

    The checkpoint carries the model's ``config.json`` and, in ``hf_assets/``, the files of the tokenizer the
    run used (``run.tokenizer_dir``: ``--tokenizer``, else the model's or the bundled one) and the
    model's generation files (``--model`` or the preset's directory; ``generation_config.json`` the
    tokenizer directory's when it has one), so ``convert --from megatron`` gives a checkpoint that
    tokenizes as the run did. For a
    quantized (ModelOpt, block-FP8) checkpoint, whose trainer holds model-dtype masters, it carries the
    masters' config (that config without ``quantization_config``) and records the quantized
    ``config.json`` (and ``hf_quant_config.json``) as the recipe the masters were trained under
    (:mod:`unified_models.converters.trained_masters`): ``convert`` gives the masters, or with
    ``--requantize`` the quantized checkpoint again."""
    config = (run.model_dir / "config.json").read_text()
    extra = {"rl": {**run_identity(run.opts), "target_token_id": run.target_token_id, "step": step,
                    "tokenizer": str(run.tokenizer_dir), "prompts_file": prompts_file(run),
                    "prompt_ids_sha256": prompt_ids_sha256(run.prompt_ids), "model_config": json.loads(config),
                    "metrics_row": json_safe(metrics_row) if metrics_row is not None else None,
                    "initial_weights_sha256": run.initial_weights_sha256}}
    quant = run.model_dir / "hf_quant_config.json"
    quant_text = quant.read_text() if run.trainer.trains_masters and quant.is_file() else None
    return run.trainer.save(run.opts.save, iteration=step, hf_config=config, hf_quant_config=quant_text,
                            assets_from=run.model_dir, tokenizer_from=run.tokenizer_dir, extra=extra,
                            overwrite=True)

