"""``unified-models rl``: GRPO with vLLM rollout, Megatron update and in-place weight sync.

The run holds one :class:`~..backends.vllm.rollout.RolloutEngine` and one
:class:`~..backends.megatron.trainer.Trainer`, both built from the spec and state
dict read once. Each step k = 1..N (one optimizer update per step, DESIGN.md rule 10):

1. **rollout** (vLLM, in process, our model class): P prompts
   (:func:`.data.prompts_for_step`) x G samples, each request with its own
   seed (:func:`.data.request_seed`), ``--max-new-tokens`` tokens at
   ``--temperature`` through the logprob op. vLLM reports the logprob of every
   sampled token; :meth:`RolloutEngine.generate` (``full_row_requests``) also returns the whole
   fp32 row it was sampled from for the first ``ceil(--full-vocab-rows / --max-new-tokens)``
   sequences. Rewards are scored and
   group-normalised (:mod:`.grpo`).
2. **recompute** (Megatron module, no grad): the trainer recomputes, from the
   same token ids and weights, packed (THD), the logprob of every sampled token
   and the recorded whole rows; they are compared with
   :mod:`unified_models.consistency.metrics`. The first token whose fp32 bits
   differ stops the run (exit 1) naming the step, sequence and position.
3. **update** (``Trainer.step``, with grad): the same forward with a graph,
   GRPO loss over the completion tokens, backward per micro-batch (gradients
   accumulate in fp32), one optimizer step (:mod:`..backends.megatron.optimizer`).
   The importance ratio trainer/old is computed per token (exactly 1 while
   diff = 0) and the forward's logprobs are compared bitwise with the
   rollout's before any backward.
4. **sync**: every parameter is copied into vLLM's existing buffers by
   Hugging Face name, derived tensors recomputed, prefix cache reset
   (:mod:`..backends.vllm.weight_sync`). Step k+1's diff = 0 proves the sync; before
   that, every tensor's weight fingerprint (a checksum of its bits on each side,
   :mod:`..consistency.fingerprint`) is compared, and a mismatch stops the run (exit 1)
   naming the tensor and the step.

Before step 1 both engines' execution-contract fingerprints are compared
(:meth:`.run.RLRun.verify_contract`); a difference is refused (exit 2) naming the
component. Metrics: ``contract_fingerprint`` (every line), ``contract_fingerprint_components``
(the first line of each process), ``weight_fingerprint`` / ``weight_fingerprint_tensors`` /
``weight_fingerprint_seconds`` (every line).

``--use-rollout-logprobs`` (old logprobs = the rollout's; saves the no-grad
forward of step 2). Rule: the first step of every process (a fresh run, and
the first step after ``--resume``) always runs the recompute and compares; from
the next step on the recompute is skipped and the comparison moves to the
update's forward (step 3), which still checks every sampled token and the
recorded rows bitwise before its backward, so a diff != 0 still stops the run
before the update it would corrupt. The metrics line says which source was
used (``old_logprobs``).

Checkpoints: ``--save DIR`` writes Megatron training checkpoints (model,
optimizer, RNG, step; :mod:`..backends.megatron.checkpoint`) every
``--save-every`` steps and after the last; ``--resume DIR`` continues from
DIR's latest one up to ``--steps``. Prompts and request seeds depend only on
``(seed, step)``, so a resumed run samples, scores and updates exactly as the
uninterrupted one.

Under ``torchrun --nproc-per-node N`` (``--ep``, ``--dp``, ``--rollout-dp``, ``--rollout-ep``):
every process holds a vLLM engine (vLLM data parallel) and a share of the trainer (Megatron
data / expert parallel); each samples, recomputes and trains on its block of GRPO groups, and
the metrics row, the first mismatch (named with its rank) and the decision to stop are merged
over all ranks (:mod:`.distributed`). Rank 0 prints and writes the metrics and the plot.

Modules: :mod:`.options` (flags, defaults, refusals), :mod:`.distributed` (layout, exchanges),
:mod:`.startup` (checkpoint, prompts, engines, resume, save), :mod:`.run` (one step),
:mod:`.report` (what is printed).
"""

from __future__ import annotations

import time
from pathlib import Path

from .. import interrupts
from .metrics import MetricsWriter
from .distributed import launch_layout
from .options import RLOptions, resolve_options, validate_options
from .report import fmt, print_summary, step_line
from .run import DiffNotZeroError
from .startup import load_run, save_checkpoint, start_engines

__all__ = ["run_rl"]


def run_rl(opts: RLOptions) -> int:
    """Run GRPO; print progress and a summary; write metrics (and plot, checkpoints).

    Returns:
        0 when every step finished with diff = 0; 1 at the first diff != 0
        (the metrics line of that step is written, then the plot).

    Raises:
        UnifiedModelsError: bad options or inputs (before any engine starts where possible).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from ..check import quiet_engines
    from .plot import plot_metrics, plot_path_for

    quiet_engines()
    opts = resolve_options(opts)
    validate_options(opts)
    layout = launch_layout(ep=opts.ep, dp=opts.dp, rollout_dp=opts.rollout_dp, rollout_ep=opts.rollout_ep,
                           num_prompts_per_step=opts.num_prompts_per_step,
                           use_rollout_logprobs=opts.use_rollout_logprobs, kl_coef=opts.kl_coef, tp=opts.tp)
    lead = layout.rank == 0  # under torchrun rank 0 prints and writes; every rank runs every step
    console, out = Console(stderr=True, quiet=not lead), Console(quiet=not lead)
    wall0 = time.perf_counter()
    with console.status("[bold]loading checkpoint and prompts[/bold]", spinner="dots"):
        run = load_run(opts, layout)
    if layout.distributed:
        console.log(f"layout: {layout.world} processes; trainer EP {layout.trainer_ep} x DP {layout.trainer_dp}, "
                    f"rollout DP {layout.rollout_dp} x EP {layout.rollout_ep} (vLLM external launcher)")
    console.log(f"model {run.model_dir} ({run.spec.family}, pattern {run.spec.extra.get('pattern')}); "
                f"tokenizer {run.tokenizer_dir}; reward {opts.reward}; {opts.num_prompts_per_step} prompts x "
                f"{opts.group_size} samples x {opts.max_new_tokens} tokens per step at T={opts.temperature:g}, "
                f"lr {opts.lr:g}, device {run.device}")
    failure: DiffNotZeroError | None = None
    saved_at: Path | None = None
    try:
        with console.status("[bold]starting vLLM and the Megatron trainer[/bold]", spinner="dots"):
            start = start_engines(run, console)
        if start:
            console.log(f"resumed from {opts.resume} at step {start}")
        contract = run.verify_contract()  # refuses (exit 2) engines whose execution contracts differ
        console.log(f"contract fingerprint {contract.digest[:16]} (vLLM = Megatron, {len(contract.shared_names())} "
                    "components); weight fingerprint checked after every sync")
        writer = MetricsWriter(opts.metrics, resume_step=start if opts.resume else None,
                               saved_row=run.saved_metrics_row) if lead else None
        if writer is not None and writer.restored_step is not None:
            console.log(f"metrics: step {writer.restored_step}'s line restored from the checkpoint (the run had "
                        "stopped after saving it, before writing the line)")
        columns = (SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), TextColumn("{task.fields[info]}"))
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("GRPO", total=opts.steps, completed=start, info="")
            for step in range(start + 1, opts.steps + 1):
                progress.update(task, description=f"step {step}")
                interrupts.progress(step)  # named by the one line a Ctrl-C prints (cli.main)
                timer = {p: 0.0 for p in ("rollout", "recompute", "update", "sync", "save")}
                t_step = time.perf_counter()
                res = run.step(step, timer)
                res.row.setdefault("importance_ratio_max", None)
                res.row.setdefault("entropy", None)
                if res.error is None and opts.save and (step == opts.steps or
                                                        (opts.save_every and step % opts.save_every == 0)):
                    t0 = time.perf_counter()
                    before = dict(res.row, seconds={k: round(v, 4) for k, v in timer.items()})
                    saved_at = save_checkpoint(run, step, metrics_row=before)
                    timer["save"] = time.perf_counter() - t0
                timer["step"] = time.perf_counter() - t_step
                res.row["seconds"] = {k: round(v, 4) for k, v in timer.items()}
                if writer is not None:
                    writer.write(res.row)
                if res.error is not None:
                    failure = res.error
                    break
                progress.console.log(step_line(res.row, opts.steps))
                progress.update(task, advance=1,
                                info=f"reward {res.row['reward_mean']:.3f}  max|Δ| {fmt(res.row['max_abs_diff'])}")
    finally:
        from ..backends.megatron import destroy_parallel_state

        if run.trainer is not None:
            run.trainer.close()
        destroy_parallel_state()  # its groups live on the process group vLLM's shutdown tears down
        if run.engine is not None:
            run.engine.close()
    if not lead:
        return 1 if failure is not None else 0
    rows = writer.rows()
    png = None
    if opts.plot and rows:
        try:
            png = plot_metrics(opts.metrics, plot_path_for(opts.metrics), title=f"GRPO {opts.reward}")
        except ImportError as e:  # the run itself is complete; say why there is no picture
            console.log(f"[yellow]no plot[/yellow]: {e} (matplotlib is in requirements-cpu.txt; "
                        "re-run ./scripts/install-cpu.sh or pip install matplotlib)")
    print_summary(out, rows, opts, png, saved_at, time.perf_counter() - wall0, failure)
    if failure is not None:
        console.print(f"[red]FAIL[/red]: {failure}")
        return 1
    return 0

