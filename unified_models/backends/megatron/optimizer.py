"""The trainer's optimizer: Megatron's on CUDA, ``torch.optim.AdamW`` on CPU, one interface.

:func:`build_optimizer` returns a :class:`TrainOptimizer`:

* **CUDA** (:class:`MegatronOptimizer`): the module is wrapped in Megatron's
  ``DistributedDataParallel`` (fp32 grad buffers ``param.main_grad``, grads
  averaged over the data-parallel group, NaN check) and stepped by
  ``get_megatron_optimizer``: Adam in AdamW mode (TE/Apex fused Adam when
  installed), bf16 model parameters with fp32 main weights
  (``Float16OptimizerWithFloat16Params``), clipping by the global grad norm.
* **CPU** (:class:`CpuAdamWOptimizer`): Megatron's DDP and optimizer classes
  allocate CUDA tensors and cannot be built on CPU
  (``reference/megatron-modelopt.md`` §2), so the CPU path is
  ``torch.optim.AdamW`` with the same hyperparameters over **Megatron's own
  parameter groups** (``_get_param_groups``: no weight decay on biases and 1-D
  parameters) and the same mixed-precision semantics: gradients accumulate in
  fp32 ``param.main_grad`` buffers (as Megatron's DDP hook does), are averaged
  over the data-parallel group, the global norm is computed by Megatron's rules
  (shared parameters excluded) and clipped by ``max_norm / (norm + 1e-6)`` when
  that is < 1, AdamW updates fp32 main weights, which are then copied (rounded
  to nearest even) into the bf16 model parameters in place. fp32 models step
  their parameters directly (Megatron's ``FP32Optimizer``). Its state dict has
  Megatron's ``Float16OptimizerWithFloat16Params`` structure and its sharded
  state dict uses Megatron's keys (``optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<name>``).
  The two paths are not bit-identical to each other (fused vs. torch Adam).

Learning rate and weight decay are constant: each group gets ``lr`` and
``weight_decay * wd_mult``, what Megatron's ``OptimizerParamScheduler`` sets
with a constant schedule.

Use (one optimizer update per rollout step)::

    opt = build_optimizer(model, OptimizerConfig(lr=1e-6))
    opt.zero_grad()
    for micro_batch in batches:          # gradients accumulate in fp32
        loss = ...(model.token_logprobs(...))
        loss.backward()
    stats = opt.step()                   # {"grad_norm", "num_zeros", "update_successful", "lr", "iteration"}
    sync_weights(llm, model.named_parameters())

Parameters are updated in place (``data_ptr`` unchanged). After each update
the weight version of every parameter is bumped through
``unified_models.ops.autograd.bump_weight_version`` when that module exists.
"""

from __future__ import annotations

import abc
import copy
import importlib
import importlib.util
import math
from dataclasses import dataclass
from typing import Any, Iterable, Literal

import torch
import torch.distributed as dist

from ...dsl import CheckpointError, SpecError
from . import compat

__all__ = ["OptimizerConfig", "TrainOptimizer", "MegatronOptimizer", "CpuAdamWOptimizer", "build_optimizer"]

Backend = Literal["auto", "megatron", "torch_adamw"]


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Adam(W) hyperparameters, shared by both backends.

    Attributes:
        lr: learning rate (constant), > 0.
        weight_decay: decoupled weight decay, >= 0 (not applied to biases and 1-D parameters).
        adam_beta1, adam_beta2: in [0, 1).
        adam_eps: > 0.
        clip_grad: clip by global L2 norm to this value; 0 disables clipping.

    Raises:
        ValueError: a value out of range (the message names the field).
    """

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "lr": self.lr > 0, "weight_decay": self.weight_decay >= 0, "adam_beta1": 0 <= self.adam_beta1 < 1,
            "adam_beta2": 0 <= self.adam_beta2 < 1, "adam_eps": self.adam_eps > 0, "clip_grad": self.clip_grad >= 0,
        }
        for name, ok in checks.items():
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or not ok:
                raise ValueError(f"OptimizerConfig.{name}={value!r} is out of range")

    def megatron(self, transformer_config) -> Any:
        """Megatron's ``OptimizerConfig`` for a module with ``transformer_config``."""
        return compat.megatron_optimizer_config(
            optimizer="adam", lr=self.lr, min_lr=self.lr, weight_decay=self.weight_decay,
            adam_beta1=self.adam_beta1, adam_beta2=self.adam_beta2, adam_eps=self.adam_eps,
            clip_grad=self.clip_grad, bf16=bool(transformer_config.bf16), fp16=False,
            params_dtype=transformer_config.params_dtype, use_distributed_optimizer=False,
            decoupled_weight_decay=True, log_num_zeros_in_grad=True)


def _apply_constant_schedule(param_groups: list[dict], cfg: OptimizerConfig) -> None:
    """What Megatron's ``OptimizerParamScheduler`` sets with a constant schedule
    (plus betas/eps): the config wins over hyperparameters restored from a checkpoint."""
    for g in param_groups:
        g["lr"] = cfg.lr
        g["weight_decay"] = cfg.weight_decay * float(g.get("wd_mult", 1.0))
        g["betas"] = (cfg.adam_beta1, cfg.adam_beta2)
        g["eps"] = cfg.adam_eps


def _bump_weight_versions(params: Iterable[torch.Tensor]) -> None:
    """Tell the ops' backward guard that these weights changed (if the ops have one)."""
    if importlib.util.find_spec("unified_models.ops.autograd") is None:
        return
    bump = getattr(importlib.import_module("unified_models.ops.autograd"), "bump_weight_version", None)
    if bump is not None:
        for p in params:
            bump(p)


class TrainOptimizer(abc.ABC):
    """One interface over both backends. ``model`` is the unwrapped ``UnifiedMegatronModel``.

    Call :meth:`zero_grad` before accumulating the gradients of one update,
    ``loss.backward()`` once per micro-batch, then :meth:`step`.
    """

    backend: str
    """``"megatron"`` (CUDA) or ``"torch_adamw"`` (CPU path)."""

    def __init__(self, model, cfg: OptimizerConfig):
        if getattr(model, "_unified_optimizer", None) is not None:
            raise RuntimeError("this model already has an optimizer; call close() on it before building another")
        if model.spec.dtype == torch.float16:
            raise SpecError("fp16 training needs loss scaling, which is not supported; use a bf16 or fp32 model")
        self.model = model
        self.config = cfg
        self.iteration = 0
        """Optimizer updates done (restored from a checkpoint)."""
        self._names = {id(p): n for n, p in model.named_parameters()}
        model._unified_optimizer = self

    @abc.abstractmethod
    def zero_grad(self) -> None:
        """Clear accumulated gradients (the fp32 ``main_grad`` buffers)."""

    @abc.abstractmethod
    def _step(self) -> tuple[bool, float, int]:
        """``(update_successful, grad_norm, num_zeros)``."""

    @abc.abstractmethod
    def state_dict(self) -> dict:
        """Megatron-structured state (``{"optimizer": ..., "fp32_from_fp16_params": ...}``)."""

    @abc.abstractmethod
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore :meth:`state_dict` (or a loaded :meth:`sharded_state_dict`)."""

    @abc.abstractmethod
    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """The optimizer part of a ``dist_checkpointing`` state dict (Megatron's keys)."""

    @abc.abstractmethod
    def _pairs(self) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """``(model parameter, main parameter)`` in optimizer order."""

    @abc.abstractmethod
    def _inners(self) -> list[torch.optim.Optimizer]:
        """The torch (or TE/Apex) optimizers stepping the main parameters."""

    def step(self) -> dict:
        """One update from the accumulated gradients.

        Returns:
            ``{"update_successful": bool, "grad_norm": float (before clipping),
            "num_zeros": int (zero gradient elements), "lr": float, "iteration": int}``.

        Raises:
            FloatingPointError: a gradient holds NaN/Inf (nothing was updated).
        """
        ok, grad_norm, num_zeros = self._step()
        if ok:
            self.iteration += 1
            _bump_weight_versions(p for p, _ in self._pairs())
        groups = [g for o in self._inners() for g in o.param_groups]
        lr = float(groups[0]["lr"]) if groups else self.config.lr
        return {"update_successful": bool(ok), "grad_norm": float(grad_norm), "num_zeros": int(num_zeros),
                "lr": lr, "iteration": self.iteration}

    def main_params(self) -> dict[str, torch.Tensor]:
        """``{HF name: fp32 main weight}`` (the parameter itself for fp32 models)."""
        return {self._names[id(p)]: main for p, main in self._pairs()}

    def param_state(self) -> dict[str, dict[str, Any]]:
        """``{HF name: optimizer state}`` (``exp_avg``, ``exp_avg_sq``, ``step``)."""
        state: dict = {}
        for o in self._inners():
            state.update(o.state)
        return {self._names[id(p)]: dict(state.get(main, {})) for p, main in self._pairs()}

    def close(self) -> None:
        """Detach from the model (removes gradient hooks) so that it can get a new optimizer
        (CPU path; a DDP-wrapped CUDA model stays bound)."""
        if getattr(self.model, "_unified_optimizer", None) is self:
            self.model._unified_optimizer = None


# --------------------------------------------------------------------------- CUDA: Megatron's own


class MegatronOptimizer(TrainOptimizer):
    """Megatron's ``DistributedDataParallel`` + ``get_megatron_optimizer`` (CUDA only)."""

    backend = "megatron"

    def __init__(self, model, cfg: OptimizerConfig):
        if next(model.parameters()).device.type != "cuda":
            raise RuntimeError("the Megatron optimizer needs the model on CUDA (Megatron's DDP allocates its "
                               "grad buffers on the GPU); use backend='torch_adamw' on CPU")
        super().__init__(model, cfg)
        self.ddp = compat.ddp_wrap(model, model.config, grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                   use_distributed_optimizer=False, check_for_nan_in_grad=True)
        self.optimizer = compat.megatron_optimizer(cfg.megatron(model.config), [self.ddp])
        _apply_constant_schedule(self.optimizer.param_groups, cfg)
        self.ddp.zero_grad_buffer()

    def _parts(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def _pairs(self):
        pairs = []
        for part in self._parts():
            if hasattr(part, "float16_groups"):
                for mg, fg in zip(part.float16_groups, part.fp32_from_float16_groups):
                    pairs += list(zip(mg, fg))
                for g in getattr(part, "fp32_from_fp32_groups", []):
                    pairs += [(p, p) for p in g]
            else:
                pairs += [(p, p) for g in part.optimizer.param_groups for p in g["params"]]
        return pairs

    def _inners(self):
        return [part.optimizer for part in self._parts() if getattr(part, "optimizer", None) is not None]

    def zero_grad(self) -> None:
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()

    def _step(self):
        try:
            self.ddp.finish_grad_sync()  # DP all-reduce of main_grad; checks for NaN/Inf first
        except RuntimeError as e:  # Megatron's rerun state machine: "found NaN in local grad norm ..."
            if "found NaN" in str(e) or "found Inf" in str(e):
                raise FloatingPointError(f"optimizer step refused: a gradient holds NaN/Inf (weights unchanged): "
                                         f"{e}") from e
            raise
        ok, grad_norm, num_zeros = self.optimizer.step()
        return ok, (grad_norm if grad_norm is not None else float("nan")), (num_zeros or 0)

    def close(self) -> None:
        """Megatron's DDP hooks cannot be removed: the model stays bound to this optimizer."""

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)
        _apply_constant_schedule(self.optimizer.param_groups, self.config)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        return self.optimizer.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading)


# --------------------------------------------------------------------------- CPU: AdamW behind the same interface


LOCAL_GROUPS_KEY = "local_param_groups"
"""Where a loading template (:meth:`CpuAdamWOptimizer.sharded_state_dict` with ``is_loading``) keeps
this optimizer's own param groups; the stored ``param_groups`` may come from another expert-parallel
layout (another number of groups) and are not used: hyperparameters come from the config."""


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """Megatron DDP's backward hook: add ``param.grad`` into fp32 ``param.main_grad`` and drop it."""
    if param.grad is not None and not getattr(param, "grad_added_to_main_grad", False):
        param.main_grad.add_(param.grad)
    param.grad = None


class CpuAdamWOptimizer(TrainOptimizer):
    """``torch.optim.AdamW`` over Megatron's parameter groups with fp32 main weights (see module doc)."""

    backend = "torch_adamw"

    def __init__(self, model, cfg: OptimizerConfig):
        super().__init__(model, cfg)
        self.mixed = model.spec.dtype == torch.bfloat16
        groups = compat.optimizer_param_groups([model], cfg.megatron(model.config))
        self.model_groups: list[list[torch.nn.Parameter]] = [list(g["params"]) for g in groups]
        with torch.no_grad():
            self.main_groups = [[p.detach().clone().float() if self.mixed else p for p in g]
                                for g in self.model_groups]
        torch_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": mains}
                        for g, mains in zip(groups, self.main_groups)]
        self.optimizer = torch.optim.AdamW(torch_groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay, foreach=False)
        _apply_constant_schedule(self.optimizer.param_groups, cfg)
        for main in (m for g in self.main_groups for m in g):  # eager state: save/load always symmetric
            self.optimizer.state[main] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(main),
                                          "exp_avg_sq": torch.zeros_like(main)}
        self._hooks = []
        for p in self._model_params():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
            self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))
        dp = compat.data_context_parallel_group()
        self._dp_group, self._dp_size = dp, dist.get_world_size(dp)
        # expert-parallel parameters (Megatron's marker allreduce=False): grads summed over the
        # expert-data-parallel group, norm squares over expert TP x EP x PP (Megatron's DDP / optimizer)
        self._expert_groups = None
        if any(not getattr(p, "allreduce", True) for p in self._model_params()):
            state = compat.expert_parallel_state()
            self._expert_groups = (state["expert_dp_group"], dist.get_world_size(state["expert_dp_group"]),
                                   state["expert_mp_group"])

    def _model_params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.model_groups for p in g]

    def _pairs(self):
        return [(p, m) for mg, fg in zip(self.model_groups, self.main_groups) for p, m in zip(mg, fg)]

    def _inners(self):
        return [self.optimizer]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        super().close()

    def zero_grad(self) -> None:
        for p, main in self._pairs():
            p.grad = None
            p.main_grad.zero_()
            main.grad = None

    @torch.no_grad()
    def _step(self):
        pairs = self._pairs()
        for p, main in pairs:
            if p.grad is not None:  # a gradient assigned without autograd (the hook never ran)
                _accumulate_main_grad(p)
            expert = not getattr(p, "allreduce", True)
            if self._dp_size > 1:  # DDP semantics: pre-scale by 1/DP, then sum (experts: over expert-DP)
                p.main_grad.mul_(1.0 / self._dp_size)
            group, size = (self._expert_groups[:2] if expert else (self._dp_group, self._dp_size))
            if size > 1:
                dist.all_reduce(p.main_grad, group=group)
            main.grad = p.main_grad  # Megatron: main_param.grad = model_param.main_grad.float()
        grads = [main.grad for p, main in pairs if not getattr(p, "shared", False)]
        if self._expert_groups is None:
            if grads:
                grad_norm = float(torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g, 2) for g in grads]), 2))
            else:
                grad_norm = 0.0
        else:  # Megatron: sqrt(dense^2 + expert^2), the expert squares summed over expert TP x EP x PP
            sq = torch.zeros(2, dtype=torch.float64)
            for p, main in pairs:
                if not getattr(p, "shared", False):
                    sq[0 if getattr(p, "allreduce", True) else 1] += float(torch.linalg.vector_norm(main.grad, 2)) ** 2
            expert_sq = sq[1:].clone()
            dist.all_reduce(expert_sq, group=self._expert_groups[2])
            grad_norm = math.sqrt(float(sq[0] + expert_sq[0]))
        if not math.isfinite(grad_norm):
            bad = [self._names[id(p)] for p, main in pairs if not bool(torch.isfinite(main.grad).all())]
            raise FloatingPointError(f"optimizer step refused: the gradient of {len(bad)} parameter(s) holds "
                                     f"NaN/Inf (weights unchanged): {bad[:5]}")
        if self.config.clip_grad > 0:
            coeff = self.config.clip_grad / (grad_norm + 1.0e-6)
            if coeff < 1.0:
                for p, main in pairs:
                    main.grad.mul_(coeff)
        num_zeros = sum(int((g == 0).sum()) for g in grads)
        self.optimizer.step()
        if self.mixed:
            for p, main in pairs:
                p.copy_(main)  # fp32 -> bf16, round to nearest even, in place
        return True, grad_norm, num_zeros

    def state_dict(self) -> dict:
        if not self.mixed:
            return self.optimizer.state_dict()
        return {"optimizer": self.optimizer.state_dict(), "fp32_from_fp16_params": self.main_groups}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a :meth:`state_dict` (or a loaded sharded one); then the config's
        lr / weight decay / betas / eps are applied again.

        Raises:
            CheckpointError: the stored parameter groups do not match this optimizer's.
        """
        state_dict = copy.copy(state_dict)
        opt = copy.copy(state_dict["optimizer"] if self.mixed else state_dict)
        if LOCAL_GROUPS_KEY in opt:  # loaded through sharded_state_dict(is_loading=True): this model's groups
            opt["param_groups"] = opt.pop(LOCAL_GROUPS_KEY)
        opt["state"] = dict(opt["state"])
        step = opt["state"].pop("common_step", None)
        if step is not None:
            opt["state"] = {k: {**v, "step": copy.deepcopy(step)} for k, v in opt["state"].items()}
        saved = [len(g["params"]) for g in opt["param_groups"]]
        mine = [len(g) for g in self.main_groups]
        if saved != mine:
            raise CheckpointError(f"optimizer state has parameter groups of sizes {saved}, this model's are {mine}")
        self.optimizer.load_state_dict(opt)
        _apply_constant_schedule(self.optimizer.param_groups, self.config)
        if self.mixed:
            with torch.no_grad():
                for cur_g, saved_g in zip(self.main_groups, state_dict["fp32_from_fp16_params"]):
                    for cur, saved_t in zip(cur_g, saved_g):
                        cur.copy_(saved_t)

    def sharded_state_dict(self, model_sharded_state_dict: dict, is_loading: bool = False) -> dict:
        """As Megatron's ``Float16OptimizerWithFloat16Params`` (``FP32Optimizer`` for fp32 models)."""
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            make_sharded_optimizer_tensor,
            optim_state_to_sharding_state,
        )

        sd = self.state_dict()
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self._model_params())
        opt = sd["optimizer"] if self.mixed else sd
        if self.mixed:
            sd["fp32_from_fp16_params"] = [
                [make_sharded_optimizer_tensor(id_map[pid], main, prefix="optimizer.state.fp32_param")
                 for pid, main in zip(sg["params"], mg)]
                for mg, sg in zip(self.main_groups, opt["param_groups"])]
        steps = [s["step"] for s in opt["state"].values() if "step" in s]
        if any(not torch.equal(s, steps[0]) for s in steps):
            raise RuntimeError("the optimizer step differs per parameter; Megatron checkpoints store one")
        optim_state_to_sharding_state(opt, id_map, exclude_keys="step")
        if steps:
            opt["state"]["common_step"] = steps[0].clone()
        if is_loading:
            # The groups (their members and multipliers) are this model's, whatever the layout that
            # saved them: at EP > 1 the expert-parallel parameters form groups of their own
            # (Megatron's _get_param_groups), so a checkpoint saved at another EP stores another
            # number of groups. Their hyperparameters come from the config (_apply_constant_schedule);
            # the per-parameter state is matched by ShardedTensor key.
            # The stored list is left to the common state (dist_checkpointing's merge refuses two
            # lists of different lengths); this template's own groups travel beside it.
            from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject

            groups = [{**g, "params": g["params"].unwrap()} for g in opt.pop("param_groups")]
            opt[LOCAL_GROUPS_KEY] = LocalNonpersistentObject(groups)
        return sd


def build_optimizer(model, cfg: OptimizerConfig | None = None, *, backend: Backend = "auto") -> TrainOptimizer:
    """The optimizer of a ``UnifiedMegatronModel`` (Megatron's parallel state must be initialized).

    Args:
        model: the module (not DDP-wrapped; the CUDA path wraps it).
        cfg: hyperparameters (default :class:`OptimizerConfig`).
        backend: ``"megatron"`` (CUDA), ``"torch_adamw"`` (the CPU path; also
            runs on CUDA) or ``"auto"`` (megatron when the parameters are on CUDA).

    Raises:
        RuntimeError: ``"megatron"`` for a CPU model, or the model already has an optimizer.
        SpecError: an fp16 model (loss scaling is not supported).
        ValueError: unknown backend.
    """
    cfg = cfg or OptimizerConfig()
    if backend not in ("auto", "megatron", "torch_adamw"):
        raise ValueError(f"backend must be 'auto', 'megatron' or 'torch_adamw', got {backend!r}")
    if backend == "auto":
        backend = "megatron" if next(model.parameters()).device.type == "cuda" else "torch_adamw"
    return MegatronOptimizer(model, cfg) if backend == "megatron" else CpuAdamWOptimizer(model, cfg)
