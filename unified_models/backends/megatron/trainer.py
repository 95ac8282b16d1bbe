"""The trainer object: one Megatron module, its parallel state and optimizer, for the life of a run.

:class:`Trainer` is what ``check`` (recompute only), ``rl`` and RL framework
adapters drive:

* :meth:`Trainer.logprobs`: every sampled token's logprob (and chosen whole
  rows), recomputed without a graph from packed (THD) prompt + completion
  sequences by the same kernels vLLM ran;
* :meth:`Trainer.step`: one optimizer update: the same forward with a graph per
  micro-batch, a caller's loss (e.g. :func:`unified_models.rl.grpo.grpo_loss`),
  backward (gradients accumulate in fp32), one step of the optimizer
  (:mod:`.optimizer`);
* :meth:`Trainer.named_weights`: the parameters by Hugging Face name, for the
  in-place sync into the rollout engine;
* :meth:`Trainer.save` / :meth:`Trainer.resume`: Megatron training checkpoints
  (:mod:`.checkpoint`).

Megatron's parallel state (TP=1, :mod:`.parallel`) is initialized by the
trainer and torn down by :meth:`Trainer.close` when the trainer initialized it.

Expert parallelism (``TrainerOptions.expert_model_parallel_size`` > 1, under
``torchrun``): every rank builds the module with its block of experts and is
given its own sequences (:func:`.parallel.shard_sequences`); because each MoE
layer exchanges rows with the other ranks of the EP group, every rank runs the
same number of forwards (and backwards): a rank with fewer micro-batches runs
one-token padding passes that score nothing (:meth:`Trainer._padding_passes`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from ...dsl import ModelSpec
from .recompute import MicroBatch, RecomputeResult, pack_sequences

__all__ = ["Trainer", "TrainerOptions", "TrainBatch", "recompute_logprobs"]


@dataclass(frozen=True, kw_only=True)
class TrainerOptions:
    """How a :class:`Trainer` is built.

    Attributes:
        optimizer: hyperparameters (:class:`~.optimizer.OptimizerConfig`); ``None``: a
            recompute-only trainer (no optimizer, :meth:`Trainer.step` refused; a model it
            builds is put in eval mode).
        reference_model: keep a frozen copy of the initial weights
            (:meth:`TrainBatch.reference_logprobs`, e.g. for a KL penalty).
        micro_batch_tokens: THD micro-batch size (default 4096 CPU / 32768 GPU).
        train_masters: a quantized (ModelOpt-format) checkpoint trains model-dtype masters
            (dequantized once; quantized on every forward by the rules the engine uses;
            ``Trainer.spec`` is then the master spec). ``None``: when ``optimizer`` is set.
            A recompute-only trainer runs the stored codes, as the engine loaded them.
        expert_model_parallel_size: EP of the trainer (Megatron's EP group; > 1 needs as many
            processes, e.g. ``torchrun --nproc-per-node EP``, and a MoE model whose expert
            counts EP divides; not with ``reference_model`` yet).
    """

    optimizer: Any = None
    reference_model: bool = False
    micro_batch_tokens: int | None = None
    train_masters: bool | None = None
    expert_model_parallel_size: int = 1


@dataclass
class TrainBatch:
    """What a :meth:`Trainer.step` loss sees of one micro-batch.

    Attributes:
        batch: the packed micro-batch (``owners``, ``flat`` slice, tensors).
        logprobs: ``[R]`` fp32 logprob of each completion token, with a graph (LM head, logprob and
            gather in row chunks of ~1 GiB of logits, forward and backward:
            :func:`unified_models.ops.lm_head_token_logprobs`).
        rows: ``[R, V]`` fp32 whole rows (``log_softmax(logits / T)``), same graph; formed on first
            access (one more LM-head GEMM, the ``[R, V]`` tensors alive until the step's backward), so a
            loss of the token logprobs alone never pays for them. Read under ``torch.no_grad()`` (a
            metric): formed without a graph and not kept, so a later access with grad forms them again
            with their graph (the same bits).
    """

    batch: MicroBatch
    logprobs: torch.Tensor
    _rows_fn: Callable[[], torch.Tensor]
    _trainer: "Trainer"
    _temperature: float
    _rows: torch.Tensor | None = field(default=None, repr=False)

    @property
    def rows(self) -> torch.Tensor:
        if self._rows is not None:
            return self._rows
        rows = self._rows_fn()
        if torch.is_grad_enabled():
            self._rows = rows
        return rows

    def reference_logprobs(self) -> torch.Tensor:
        """``[R]`` fp32 logprobs of the frozen initial weights (no graph).

        Raises:
            RuntimeError: the trainer was built without ``reference_model``.
        """
        ref = self._trainer.reference_model
        if ref is None:
            raise RuntimeError("this Trainer has no reference model (TrainerOptions(reference_model=True))")
        b = self.batch
        with torch.no_grad():
            return ref.token_logprobs(b.input_ids, b.cu_seqlens, b.rows, self._temperature).float()


class Trainer:
    """One :class:`~.module.UnifiedMegatronModel` (+ optimizer) for the life of a run.

    Args:
        spec: the model (the one the state dict was validated against).
        weights: ``{HF name: tensor}`` (e.g. from ``spec_and_state_dict``), or a built
            ``UnifiedMegatronModel`` of ``spec``, used as is.
        device: ``"cpu"`` or ``"cuda"``.
        options: :class:`TrainerOptions` (default: recompute only).

    Raises:
        CheckpointError: missing, unexpected or mis-shaped tensors, NaN/Inf, bad scales.
        ParallelismError: Megatron's parallel state holds another layout.
    """

    def __init__(self, spec: ModelSpec, weights: Mapping[str, torch.Tensor] | Any, *, device: str = "cpu",
                 options: TrainerOptions | None = None):
        from . import compat
        from .module import UnifiedMegatronModel, transformer_config_from_spec
        from .parallel import init_parallel_state

        from ...ops.grad.helpers import backward_gemm_mode

        backward_gemm_mode()  # a bad UM_BACKWARD_GEMM is refused here, not at the first backward on a GPU
        self.options = options = options or TrainerOptions()
        self.device = device
        self.optimizer = None
        self.reference_model = None
        stale = compat.model_parallel_is_initialized() and not torch.distributed.is_initialized()
        self._owns_parallel_state = stale or not compat.model_parallel_is_initialized()
        self.ep = int(options.expert_model_parallel_size)
        if self.ep > 1 and options.reference_model:
            from ...dsl import ParallelismError

            raise ParallelismError("Trainer: a reference model at expert_model_parallel_size > 1 is not supported yet "
                                   "(its forwards inside a loss would need padding passes of their own); use EP=1 "
                                   "or no reference model")
        init_parallel_state(tp=1, ep=self.ep)
        train_masters = options.optimizer is not None if options.train_masters is None else options.train_masters
        self.trains_masters = bool(train_masters and spec.stores_quantized_weights)
        """True when a quantized checkpoint's masters are trained: the engine needs a sync of
        them (re-quantized) before its first rollout, dequantize -> quantize not being the identity."""
        if isinstance(weights, UnifiedMegatronModel):
            if self.trains_masters:
                raise ValueError("Trainer: pass the state dict of a quantized checkpoint (its masters are derived "
                                 "here), not a built model")
            self.model = weights
            state = None
        else:
            state = weights
            if self.trains_masters:
                from ...converters.modelopt import dequantize_state_dict, master_spec

                state = dequantize_state_dict(state, spec)
                spec = master_spec(spec)
            cfg = transformer_config_from_spec(spec, perform_initialization=False,
                                               expert_model_parallel_size=self.ep)
            self.model = UnifiedMegatronModel(spec, cfg, device=device)
            self.model.load_hf_state_dict(state)
            if options.optimizer is None:
                self.model.eval()
        self.spec: ModelSpec = self.model.spec
        if options.reference_model:
            self.reference_model = UnifiedMegatronModel(self.spec, self.model.config, device=device)
            self.reference_model.load_hf_state_dict(
                state if state is not None else {n: p.detach() for n, p in self.model.named_parameters()})
            self.reference_model.requires_grad_(False)
            self.reference_model.eval()
        if options.optimizer is not None:
            from .optimizer import build_optimizer

            self.optimizer = build_optimizer(self.model, options.optimizer)

    # ------------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Detach the optimizer; tear down Megatron's parallel state if this trainer set it up (idempotent)."""
        from .parallel import destroy_parallel_state

        if self.optimizer is not None:
            self.optimizer.close()
            self.optimizer = None
        if self._owns_parallel_state:
            destroy_parallel_state()  # its groups live on a process group vLLM's shutdown may tear down
            self._owns_parallel_state = False

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ forward

    @property
    def micro_batch_tokens(self) -> int:
        return self.options.micro_batch_tokens or (32768 if self.device == "cuda" else 4096)

    def pack(self, prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]) -> list[MicroBatch]:
        """THD micro-batches of ``prompt + completion`` sequences (:func:`.recompute.pack_sequences`)."""
        return pack_sequences(prompt_ids, completions, self.micro_batch_tokens, self.device)

    @torch.no_grad()
    def logprobs(self, prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], *,
                 temperature: float = 1.0, full_rows_for: Iterable[tuple[int, int]] | None = None) -> RecomputeResult:
        """Logprob of every completion token (no graph), packed THD.

        Args:
            prompt_ids, completions: token ids per sequence.
            temperature: as in the rollout.
            full_rows_for: ``(sequence index, position)`` keys whose whole row to return
                (position = ``len(prompt) - 1 + j`` for completion token ``j``).

        Returns:
            :class:`~.recompute.RecomputeResult` (fp32, on the CPU).

        Raises:
            ValueError: lengths of ``prompt_ids`` and ``completions`` differ.
        """
        wanted = set(full_rows_for or ())
        out: list[torch.Tensor | None] = [None] * len(prompt_ids)
        full: dict[tuple[int, int], torch.Tensor] = {}
        mbs = self.pack(prompt_ids, completions)
        for _ in range(self._padding_passes(sum(mb.rows.numel() > 0 for mb in mbs))):
            self._padding_pass(temperature)
        for mb in mbs:
            if mb.rows.numel() == 0:
                for s in mb.seqs:
                    out[s] = torch.zeros(0)
                continue
            # per-row keys only when whole rows are wanted (mb.owners is built on first use)
            keys = [(s, len(prompt_ids[s]) - 1 + j) for s, j in mb.owners] if wanted else []
            need_full = any(k in wanted for k in keys)
            res = self.model.token_logprobs(mb.input_ids, mb.cu_seqlens, mb.rows, temperature, return_full=need_full)
            tok, rows_full = (res if need_full else (res, None))
            tok = tok.cpu()
            k = 0
            for s in mb.seqs:
                n = len(completions[s])
                out[s] = tok[k:k + n]
                k += n
            if rows_full is not None:
                for r, key in enumerate(keys):
                    if key in wanted:
                        full[key] = rows_full[r].cpu()
        return RecomputeResult(logprobs=out, full_rows=full)

    def step(self, prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
             loss_fn: Callable[[TrainBatch], torch.Tensor], *, temperature: float = 1.0) -> dict:
        """One optimizer update over all sequences.

        Gradients are cleared, then per THD micro-batch: the forward with a graph
        (completion-token logprobs and whole rows), ``loss = loss_fn(TrainBatch)``,
        ``loss.backward()`` (gradients accumulate in fp32); then one optimizer step.
        ``loss_fn`` may raise to stop before that micro-batch's backward (nothing is
        stepped then; the next :meth:`step` clears the partial gradients).

        Returns:
            The optimizer's stats (``grad_norm``, ``update_successful``, ``num_zeros``, ``lr``, ``iteration``).

        Raises:
            RuntimeError: a recompute-only trainer (no optimizer); gradients disabled (called under
                ``torch.no_grad()`` or ``torch.inference_mode()``; nothing is changed).
            FloatingPointError: a gradient holds NaN/Inf (nothing was updated).
        """
        if self.optimizer is None:
            raise RuntimeError("this Trainer was built without an optimizer (TrainerOptions(optimizer=...))")
        if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
            raise RuntimeError("Trainer.step needs gradients: it was called under torch.no_grad() or "
                               "torch.inference_mode(); call it outside them (nothing was changed)")
        self.optimizer.zero_grad()
        mbs = self.pack(prompt_ids, completions)
        for _ in range(self._padding_passes(len(mbs))):
            self._padding_pass(temperature, backward=True)
        for mb in mbs:
            tok_R, rows_fn = self.model.token_logprobs_and_rows(mb.input_ids, mb.cu_seqlens, mb.rows, temperature)
            train_batch = TrainBatch(batch=mb, logprobs=tok_R, _rows_fn=rows_fn, _trainer=self,
                                     _temperature=temperature)
            loss = loss_fn(train_batch)
            loss.backward()
            del tok_R, rows_fn, train_batch, loss
        return self.optimizer.step()

    def _padding_passes(self, mine: int) -> int:
        """EP > 1: how many one-token passes this rank adds so that every rank of the EP group runs as
        many forwards (and backwards) as the busiest one (their MoE all-to-alls pair up); 0 at EP = 1."""
        group = getattr(getattr(self.model, "_dispatcher", None), "group", None)
        if self.ep == 1 or group is None:
            return 0
        n = torch.tensor([mine], dtype=torch.int64)
        torch.distributed.all_reduce(n, op=torch.distributed.ReduceOp.MAX, group=group)
        return int(n) - mine

    def _padding_pass(self, temperature: float, backward: bool = False) -> None:
        """One forward over a one-token sequence whose result is dropped (with ``backward``: a zero
        loss's backward, which runs the reverse all-to-alls and adds nothing to any gradient)."""
        ids = torch.zeros(1, dtype=torch.long, device=self.device)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=self.device)
        rows = torch.zeros(1, dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            lp = self.model.token_logprobs(ids, cu, rows, temperature, target_ids=ids)
            if backward:
                (lp.sum() * 0.0).backward()

    # ------------------------------------------------------------------ weights and checkpoints

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """``(HF name, parameter)`` of every floating-point parameter (for ``RolloutEngine.sync_weights``).

        Integer tables (DeepSeek-V4's hash-routing ``tid2eid``) are never trained and are left
        out: the engine holds them from the same checkpoint."""
        return ((n, p) for n, p in self.model.named_parameters() if p.is_floating_point())

    def contract_fingerprint(self):
        """This trainer's execution-contract fingerprint
        (:func:`unified_models.consistency.fingerprint.contract_fingerprint` over its module's spec,
        parameters and device, with the Megatron-own component ``megatron.version``)."""
        from ...consistency.fingerprint import contract_fingerprint, library_version

        params = dict(self.model.named_parameters())
        device = next(iter(params.values())).device
        if self.ep > 1:  # experts other EP ranks hold: stored as this rank's of the same layer and projection
            from ...layers.weight_formats import linear_fields
            from .parallel import expert_groups

            for _, linears in expert_groups(self.spec):
                for field in linear_fields(self.spec.weight_format(linears[0])):
                    names = [f"{n}.{field}" for n in linears]
                    here = next(params[n] for n in names if n in params)
                    params.update({n: torch.empty(0, dtype=here.dtype, device="meta") for n in names if n not in params})
        return contract_fingerprint("megatron", self.spec, params, device,
                                    engine_components={"version": library_version("megatron.core")})

    def save(self, root: str | os.PathLike, *, iteration: int | None = None, hf_config: Any = None,
             hf_quant_config: Any = None, assets_from: str | os.PathLike | None = None,
             tokenizer_from: str | os.PathLike | None = None, extra: Mapping[str, Any] | None = None,
             overwrite: bool = False):
        """Write a Megatron training checkpoint (model, optimizer, RNG, iteration); see
        :func:`.checkpoint.save_training_checkpoint` (``hf_config``: the checkpoint's config the
        trainer was built from; for trained masters the quantized one, recorded as the recipe;
        ``assets_from``: that checkpoint's directory, whose tokenizer files go to ``hf_assets/``;
        ``tokenizer_from``: the tokenizer directory used instead, whose tokenizer files go there).
        Returns the ``iter_*`` directory."""
        from .checkpoint import save_training_checkpoint

        if self.optimizer is None:
            raise RuntimeError("this Trainer was built without an optimizer: nothing to save a training state of")
        return save_training_checkpoint(root, self.model, self.optimizer, iteration=iteration, hf_config=hf_config,
                                        hf_quant_config=hf_quant_config, assets_from=assets_from,
                                        tokenizer_from=tokenizer_from, extra=extra, overwrite=overwrite)

    def resume(self, path: str | os.PathLike, *, iteration: int | None = None):
        """Restore model, optimizer, RNG and iteration in place; see
        :func:`.checkpoint.load_training_checkpoint` (returns its ``TrainingCheckpoint``)."""
        from .checkpoint import load_training_checkpoint

        if self.optimizer is None:
            raise RuntimeError("this Trainer was built without an optimizer: nothing to resume")
        return load_training_checkpoint(path, self.model, self.optimizer, iteration=iteration)


def recompute_logprobs(spec: ModelSpec, state_dict: Mapping[str, torch.Tensor], prompt_ids: list[list[int]],
                       completions: list[list[int]], *, device: str = "cpu", temperature: float = 1.0,
                       full_rows_for: list[tuple[int, int]] | None = None,
                       max_tokens_per_batch: int | None = None) -> RecomputeResult:
    """Logprob of every sampled token, recomputed by the Megatron module (a one-shot
    :class:`~.trainer.Trainer`; keep a trainer to recompute more than once).

    Args:
        spec, state_dict: the model and its HF-named weights (the rollout's weights).
        prompt_ids, completions: token ids per sequence.
        device: ``"cpu"`` or ``"cuda"``.
        temperature: as in the rollout.
        full_rows_for: ``(sequence index, position)`` keys whose whole row to return.
        max_tokens_per_batch: THD micro-batch size (default 4096 CPU / 32768 GPU).
            Packing never changes a bit (each row depends only on its own sequence).

    Returns:
        :class:`RecomputeResult`.

    Raises:
        ValueError: lengths of ``prompt_ids`` and ``completions`` differ.
    """
    if len(prompt_ids) != len(completions):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completions)} completions")
    with Trainer(spec, state_dict, device=device,
                 options=TrainerOptions(micro_batch_tokens=max_tokens_per_batch)) as trainer:
        return trainer.logprobs(prompt_ids, completions, temperature=temperature, full_rows_for=full_rows_for)
