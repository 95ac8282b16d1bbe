"""``UnifiedMegatronModel``: a Megatron-core module that runs the single forward program.

The module owns no math: it registers the spec's parameters under their
Hugging Face names (nested modules mirroring the dotted names, so
``named_parameters()`` yields exactly :meth:`ModelSpec.parameter_shapes`) and
calls :func:`unified_models.forward.forward_hidden` with the trainer's private
state store (:class:`unified_models.private_state.PrivateStateStore`, mirroring vLLM's
KV-cache groups), the same program and kernels vLLM runs. It plugs into Megatron
through ``config`` / ``model_type`` / ``set_input_tensor`` (what the schedules
look up), parameter tensor-parallel attributes (what the optimizer and grad
norm read) and :meth:`sharded_state_dict` (what ``dist_checkpointing`` reads).

Inputs are packed sequences (THD): ``input_ids [T]`` (or ``[1, T]``, Megatron's
one concatenated micro-batch row) with boundaries ``cu_seqlens [B+1]`` or a
Megatron ``PackedSeqParams(qkv_format="thd", ...)``.

Shapes: T tokens, B sequences, R selected rows, D hidden, V vocabulary.

Training: with grad mode on and trainable parameters, :meth:`forward` and
:meth:`token_logprobs` build an autograd graph through the ops'
``torch.autograd.Function`` s (:mod:`unified_models.ops.autograd`), so
``loss.backward()`` fills ``.grad`` of the parameters (in ``spec.dtype``;
roundings of the forward pass gradients straight through). The values are
bitwise the same as under ``torch.no_grad()``: every forward value still
comes from the shared kernels; attention takes its gradient from a plain-torch
recomputation. Parameters carry their HF names for the weight-version guard:
a backward whose forward saw other weight values raises
:class:`unified_models.ops.StaleWeightError` naming the parameter. In-place
torch updates (``p.add_``, ``p.copy_``, torch optimizers) are seen by
themselves; after writes through ``p.data`` (Megatron's optimizer) call
``unified_models.ops.bump_weight_version(model)``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import torch

from megatron.core.enums import ModelType
from megatron.core.tensor_parallel import set_defaults_if_not_set_tensor_model_parallel_attributes
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

from ...dsl import CheckpointError, ModelSpec, SpecError
from ...layers import family_of, megatron_fields, residual_policy
from ...layers.expert_parallel import ShardPlan
from ...layers.expert_shards import local_expert_stacks
from ...forward import forward_hidden, forward_logprobs, forward_token_logprobs
from ...ops import gather_token_logprobs, name_weights
from ...state import FlatBatch
from ...private_state import PrivateStateStore, StateBuffers
from ...parameters import allocate_parameters
from . import compat
from .parallel import check_current_parallel_state, check_expert_layout, check_parallel_sizes, expert_groups

__all__ = ["UnifiedMegatronModel", "transformer_config_from_spec"]


def transformer_config_from_spec(spec: ModelSpec, **overrides: Any) -> TransformerConfig:
    """A Megatron ``TransformerConfig`` describing ``spec``.

    Sets the sizes Megatron components read (``num_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_query_groups``, ``kv_channels``,
    ``ffn_hidden_size`` and each layer family's own sizes, from
    :func:`unified_models.layers.megatron_fields` (Mamba:
    ``mamba_{num_heads,head_dim,num_groups,state_dim}``; MoE: ``num_moe_experts``,
    ``moe_router_topk``, ``moe_ffn_hidden_size``, sigmoid scoring, ...; kept where
    the installed Megatron has those fields), precision
    (``bf16``/``fp16``, ``params_dtype``), dropouts 0 (Megatron's default is
    0.1) and TP/PP/CP/EP sizes 1. A spec without attention layers describes
    one head of ``hidden_size`` channels (Megatron requires a head count).
    ``overrides`` are passed to ``TransformerConfig`` as given (unknown
    fields fail there).

    Raises:
        ParallelismError: an override asks for a refused parallel size.
    """
    fields = megatron_fields(spec)  # each family's sizes (layers.LayerFamily.megatron_fields)
    heads = fields.pop("num_attention_heads", 1)
    defaults: dict[str, Any] = dict(
        num_layers=len(spec.blocks),
        hidden_size=spec.hidden_size,
        num_attention_heads=heads,
        num_query_groups=fields.pop("num_query_groups", heads),
        kv_channels=fields.pop("kv_channels", max(1, spec.hidden_size // heads)),
        ffn_hidden_size=fields.pop("ffn_hidden_size", 4 * spec.hidden_size),
        bf16=spec.dtype == torch.bfloat16,
        fp16=spec.dtype == torch.float16,
        params_dtype=spec.dtype,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        sequence_parallel=False,
        add_bias_linear=fields.pop("add_bias_linear", False),
        normalization="RMSNorm",
        layernorm_epsilon=spec.final_norm.eps,
    )
    defaults.update(fields)
    defaults = compat.filter_dataclass_kwargs(TransformerConfig, defaults)
    defaults.update(overrides)
    check_parallel_sizes(
        tensor_model_parallel_size=defaults.get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=defaults.get("pipeline_model_parallel_size", 1),
        context_parallel_size=defaults.get("context_parallel_size", 1),
        expert_model_parallel_size=defaults.get("expert_model_parallel_size", 1),
        where="transformer_config_from_spec")
    check_expert_layout(spec, defaults.get("expert_model_parallel_size", 1), where="transformer_config_from_spec")
    return TransformerConfig(**defaults)


def _check_config(spec: ModelSpec, config: TransformerConfig) -> None:
    check_parallel_sizes(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        where="UnifiedMegatronModel config")
    check_expert_layout(spec, config.expert_model_parallel_size, where="UnifiedMegatronModel config")
    if config.num_layers != len(spec.blocks) or config.hidden_size != spec.hidden_size:
        raise SpecError(
            f"TransformerConfig(num_layers={config.num_layers}, hidden_size={config.hidden_size}) does not "
            f"describe the {spec.family} spec ({len(spec.blocks)} layers, hidden {spec.hidden_size})")
    if config.params_dtype != spec.dtype:
        raise SpecError(f"TransformerConfig.params_dtype={config.params_dtype} differs from spec.dtype={spec.dtype}")


def _expert_parallel(spec: ModelSpec, ep: int):
    """``(ShardPlan, dispatcher)`` of this rank: EP = 1 -> every expert here (the layers' default
    dispatcher); EP > 1 -> its place in Megatron's EP group and the all-to-all dispatcher over it.

    Raises:
        ParallelismError: EP does not divide an expert count, or Megatron's parallel state is not
            initialized with this EP.
    """
    check_expert_layout(spec, ep, where="UnifiedMegatronModel")
    if ep == 1:
        return ShardPlan(), None
    from ...dsl import ParallelismError
    from ...layers.expert_all_to_all import AllToAllExperts

    if not compat.model_parallel_is_initialized() or compat.parallel_sizes()["expert_model_parallel_size"] != ep:
        raise ParallelismError(
            f"UnifiedMegatronModel: expert_model_parallel_size={ep} needs Megatron's parallel state initialized "
            f"with the same EP (unified_models.backends.megatron.init_parallel_state(ep={ep}) under torchrun)")
    state = compat.expert_parallel_state()
    return ShardPlan(ep_size=state["ep_size"], ep_rank=state["ep_rank"]), AllToAllExperts(state["ep_group"])


def _allocate(spec: ModelSpec, device: torch.device, plan: ShardPlan):
    """``(HF name, uninitialised tensor, is routed expert)`` in model order: every parameter of
    ``spec`` except the routed experts other EP ranks hold. EP = 1: exactly
    :func:`unified_models.parameters.allocate_parameters`. EP > 1: this rank's experts of each
    stacked group are views of one ``[E / EP, ...]`` buffer (as the whole group is at EP = 1)."""
    from ...layers.weight_formats import linear_fields

    experts: dict[str, bool] = {}  # expert tensor name -> held here
    local_views: dict[str, torch.Tensor] = {}
    dtypes, shapes = spec.parameter_dtypes(), spec.parameter_shapes()
    for _, linears in expert_groups(spec):
        mine = plan.local_experts(len(linears))
        for field in linear_fields(spec.weight_format(linears[0])):
            names = [f"{n}.{field}" for n in linears]
            experts.update({n: j in mine for j, n in enumerate(names)})
            if plan.ep_size > 1:
                buf = torch.empty((len(mine), *shapes[names[0]]), dtype=dtypes[names[0]], device=device)
                local_views.update({names[j]: buf[i] for i, j in enumerate(mine)})
    tensors = allocate_parameters(spec, device) if plan.ep_size == 1 else None
    for name, shape in shapes.items():
        if not experts.get(name, True):
            continue
        t = tensors[name] if tensors is not None else local_views.get(name)
        if t is None:
            t = torch.empty(shape, dtype=dtypes[name], device=device)
        yield name, t, name in experts


_local_expert_stacks = local_expert_stacks  # engine-neutral: layers.expert_shards (the vLLM model uses it too)


def _default_device(config: TransformerConfig) -> torch.device:
    if torch.cuda.is_available() and not config.use_cpu_initialization:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class UnifiedMegatronModel(MegatronModule):
    """Megatron-core module of a :class:`ModelSpec`, computing with the shared forward.

    Args:
        spec: the model.
        config: Megatron config; default :func:`transformer_config_from_spec`.
        device: parameter device; default the current CUDA device, else CPU.
        block_size: page size of the private KV cache (does not change any
            result bit: attention tiles are aligned at absolute positions).

    Expert parallelism (``config.expert_model_parallel_size`` = EP > 1, Megatron's parallel
    state initialized with the same EP): this rank holds only its contiguous block of
    ``E / EP`` routed experts of every MoE layer (:class:`ShardPlan`, Megatron's layout),
    registered under their global Hugging Face names (``...experts.<global e>...``) and
    marked as Megatron marks expert-parallel parameters (``allreduce = False``: DDP reduces
    them over the expert-data-parallel group, the optimizer groups them as
    ``is_expert_parallel``). The forward sends each token-expert assignment to the expert's
    owner over Megatron's EP group and combines at the token's rank
    (:class:`unified_models.layers.expert_all_to_all.AllToAllExperts`): bitwise EP = 1's logprobs.

    Raises:
        ParallelismError: TP, PP or CP > 1 in ``config`` or in Megatron's
            initialized parallel state; EP not dividing a MoE layer's expert count;
            EP > 1 without Megatron's parallel state at that EP.
        SpecError: ``config`` does not describe ``spec``.
    """

    def __init__(self, spec: ModelSpec, config: TransformerConfig | None = None, *,
                 device: torch.device | str | None = None, block_size: int = 64):
        if config is None:
            config = transformer_config_from_spec(spec)
        _check_config(spec, config)
        check_current_parallel_state("UnifiedMegatronModel")
        super().__init__(config)
        self.spec = spec
        self.model_type = ModelType.encoder_or_decoder
        self.block_size = int(block_size)
        device = torch.device(device) if device is not None else _default_device(config)
        ep = int(config.expert_model_parallel_size)
        self.shard_plan, self._dispatcher = _expert_parallel(spec, ep)
        embed_names = {f"{spec.embedding.name}.weight"}
        if spec.lm_head.tied_to is None:
            embed_names.add(f"{spec.lm_head.name}.weight")
        frozen = spec.untrained_parameter_names()
        self._expert_names: set[str] = set()  # routed-expert tensors this rank holds (global HF names)
        for name, tensor, is_expert in _allocate(spec, device, self.shard_plan):
            # quantization scales / codes and the router's correction bias are never trained
            param = torch.nn.Parameter(tensor, requires_grad=name not in frozen)
            set_defaults_if_not_set_tensor_model_parallel_attributes(param)  # TP=1: not TP-parallel
            if is_expert:
                param.allreduce = ep == 1  # Megatron's expert-parallel marker (transformer/moe/experts.py)
                self._expert_names.add(name)
            if name in embed_names:
                param.is_embedding_or_output_parameter = True
            self._register_nested(name, param)
        name_weights(self.named_parameters())  # parameter names in weight-version guard errors
        if config.perform_initialization:
            self.reset_parameters()

    # ------------------------------------------------------------------ construction

    def _register_nested(self, name: str, param: torch.nn.Parameter) -> None:
        *path, leaf = name.split(".")
        module: torch.nn.Module = self
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, param)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Megatron-style init: weights ``config.init_method`` (normal, std
        ``init_method_std``), norm weights 1, biases 0; each family's own rules
        (:attr:`unified_models.layers.LayerFamily.init_rules`: Mamba-2 as
        transformers' ``NemotronHMamba2Mixer``, MoE correction bias 0) and the residual
        policy's (``init_rules`` when it has them; mHC: ``base`` 0, ``scale`` 1); static FP8
        scales (``input_scale``, ``k_scale``, ``v_scale``) 1.0 (vLLM's default KV scale;
        calibrate before exporting).

        Raises:
            SpecError: a spec with stored quantized weights (codes are not initialised:
                build the module from ``converters.modelopt.master_spec``).
        """
        if self.spec.stores_quantized_weights:
            raise SpecError("a ModelOpt-format spec (stored NVFP4/FP8 codes) cannot be randomly initialised; "
                            "build the module from unified_models.converters.modelopt.master_spec(spec)")
        norms = {f"{s.norm.name}.weight" for s in self.spec.sublayers} | {f"{self.spec.final_norm.name}.weight"}
        special: dict[str, Any] = {}
        for sub in self.spec.sublayers:
            special.update(family_of(sub.mixer, sub.index).init_rules(sub.mixer))
        policy_rules = getattr(residual_policy(self.spec.residual), "init_rules", None)  # mHC: base 0, scale 1
        if policy_rules is not None:
            special.update(policy_rules(self.spec.residual))
        embed = f"{self.spec.embedding.name}.weight"
        embed_init = getattr(self.config, "embedding_init_method", None) or self.config.init_method
        for name, p in self.named_parameters():
            if name in special:
                special[name](p)
            elif name.endswith(("input_scale", "k_scale", "v_scale")):
                p.fill_(1.0)
            elif name in norms:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            elif name == embed:
                embed_init(p)
            else:
                self.config.init_method(p)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, config: TransformerConfig | None = None, *,
                        device: torch.device | str | None = None, block_size: int = 64) -> "UnifiedMegatronModel":
        """Build from a Hugging Face checkpoint directory (config.json + safetensors).

        Raises:
            CheckpointError / SpecError: see :func:`hf_safetensors.spec_and_state_dict`.
        """
        from ...converters.hf_safetensors import spec_and_state_dict

        _, spec, state_dict = spec_and_state_dict(model_dir)
        if config is None:
            config = transformer_config_from_spec(spec, perform_initialization=False)
        model = cls(spec, config, device=device, block_size=block_size)
        model.load_hf_state_dict(state_dict)
        return model

    @torch.no_grad()
    def load_hf_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy a canonical ``{HF name: tensor}`` state dict into the parameters (in place).

        Raises:
            CheckpointError: missing, unexpected or mis-shaped tensors (all named), NaN/Inf,
                bad quantization scales (missing, zero, negative, NaN, Inf; named).
        """
        from ...converters.hf_safetensors import validate_state_dict

        validate_state_dict(dict(state_dict), self.spec, source="state_dict")
        if self.spec.untrained_parameter_names():  # quantization scales / codes: zero, NaN, Inf are errors
            from ...converters.modelopt import validate_quantized

            validate_quantized(state_dict, self.spec, source="state_dict")
        for name, p in self.named_parameters():
            p.copy_(state_dict[name].to(device=p.device, dtype=p.dtype))

    def load_dist_checkpoint(self, ckpt_dir: str | os.PathLike) -> None:
        """Load a Megatron dist checkpoint (as written by :mod:`.dist_ckpt`)
        through ``dist_checkpointing.load`` into this module's :meth:`sharded_state_dict`.

        Raises:
            CheckpointError: not a checkpoint, written for another model, corrupt.
        """
        from ...converters.megatron_dist_ckpt import describe_error, verify_digests
        from .dist_ckpt import check_dist_checkpoint

        info = check_dist_checkpoint(ckpt_dir, spec=self.spec)
        try:
            loaded = compat.dist_load(self.sharded_state_dict(), ckpt_dir)
        except compat.reader_exception_types() as e:  # noqa: BLE001 - any reader failure means a bad checkpoint
            raise CheckpointError(f"Megatron checkpoint {ckpt_dir} could not be loaded: {describe_error(e)}") from None
        same_dtype = {n: loaded[n] for n, _ in self.named_parameters()
                      if loaded[n].dtype == info.tensors_metadata[n].dtype}  # digests cover stored bytes
        verify_digests(same_dtype, info.digests, str(ckpt_dir))
        with torch.no_grad():
            for name, p in self.named_parameters():
                t = loaded[name]
                if t is not p:
                    p.copy_(t.to(device=p.device, dtype=p.dtype))

    # ------------------------------------------------------------------ Megatron hooks

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline hook; a no-op (one pipeline stage)."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: dict | None = None) -> dict:
        """ShardedTensors keyed by ``prefix + HF name``, replicated (TP=1).

        Each ShardedTensor's ``data`` is the Parameter itself (optimizer state
        is matched by ``id``); replica id ``(0, tp_rank, dp_rank)`` so only DP
        rank 0 writes. Needs Megatron's parallel state (:func:`init_parallel_state`).

        Expert parallelism: each routed expert's tensor is one ShardedTensor under its
        global HF name (``...experts.<global e>...``, the global expert offset is the index
        in the key: Megatron's ``singleton_local_shards`` expert layout), held by its owner
        only, with replica id ``(0, expert_tp_rank, expert_dp_rank)``. The checkpoint is
        therefore the same at every EP: saved at EP = 2 it reloads at EP = 1 (and back)
        bit for bit, and converts to Hugging Face unchanged.

        Raises:
            ParallelismError: the parallel state holds a refused layout.
            RuntimeError: the parallel state is not initialized.
        """
        check_current_parallel_state("UnifiedMegatronModel.sharded_state_dict")
        if not compat.model_parallel_is_initialized():
            raise RuntimeError("sharded_state_dict needs Megatron's parallel state: call "
                               "unified_models.backends.megatron.init_parallel_state() first")
        tp_group = getattr(self, "tp_group", None) or compat.tensor_parallel_group()
        dp_cp_group = (metadata or {}).get("dp_cp_group") or compat.data_context_parallel_group()
        groups = {False: (tp_group, dp_cp_group)}
        if self.shard_plan.ep_size > 1:  # experts: replicas over expert-TP x expert-DP (Megatron's)
            state = compat.expert_parallel_state()
            groups[True] = (state["expert_tp_group"], state["expert_dp_group"])
        out = {}
        for name, param in self.named_parameters():
            tp, dp = groups[self.shard_plan.ep_size > 1 and name in self._expert_names]
            out[f"{prefix}{name}"] = compat.replicated_sharded_tensor(
                param, f"{prefix}{name}", prepend_offsets=sharded_offsets, tp_group=tp, dp_cp_group=dp)
        return out

    # ------------------------------------------------------------------ forward

    def _params(self) -> dict[str, torch.Tensor]:
        params = dict(self.named_parameters())
        if self.shard_plan.ep_size > 1:
            params.update(_local_expert_stacks(self.spec, params, self.shard_plan))
        return params

    def _device(self) -> torch.device:
        return next(self.parameters()).device

    def _flat_inputs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None,
                     packed_seq_params: Any) -> tuple[torch.Tensor, torch.Tensor, bool]:
        if input_ids.dim() == 2:
            if input_ids.shape[0] != 1:
                raise ValueError(f"input_ids {tuple(input_ids.shape)}: packed THD input is one row [1, T]; "
                                 "concatenate the sequences and pass cu_seqlens")
            ids_T, batched = input_ids[0], True
        elif input_ids.dim() == 1:
            ids_T, batched = input_ids, False
        else:
            raise ValueError(f"input_ids must be [T] or [1, T], got {tuple(input_ids.shape)}")
        if ids_T.is_floating_point():
            raise ValueError(f"input_ids must be integer token ids, got {ids_T.dtype}")
        device = self._device()
        ids_T = ids_T.to(device)
        t = ids_T.shape[0]
        if cu_seqlens is not None and packed_seq_params is not None:
            raise ValueError("pass either cu_seqlens or packed_seq_params, not both")
        if packed_seq_params is not None:
            cu_seqlens = compat.packed_seq_cu_seqlens(packed_seq_params)
        if cu_seqlens is None:
            cu = torch.tensor([0, t], dtype=torch.int64, device=device)
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.int64).reshape(-1)
        if cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing with at least 2 entries, "
                             f"got {cu.tolist()}")
        end = int(cu[-1])
        if end > t:
            raise ValueError(f"cu_seqlens ends at {end} but input_ids has {t} tokens")
        if end < t:  # trailing tokens past the last boundary form one extra (padding) sequence, as in Megatron
            cu = torch.cat([cu, cu.new_tensor([t])])
        vocab = self.spec.vocab_size
        if t and (int(ids_T.min()) < 0 or int(ids_T.max()) >= vocab):
            raise ValueError(f"input_ids hold ids outside [0, {vocab})")
        return ids_T, cu, batched

    def _hidden(self, ids_T: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, FlatBatch]:
        batch = FlatBatch.from_cu_seqlens(ids_T, cu)
        seq_lens = (cu[1:] - cu[:-1]).tolist()
        buffers = None
        if not torch.is_grad_enabled():  # recompute: reuse the caches' storage (a graph may save them)
            buffers = self.__dict__.setdefault("_state_buffers", StateBuffers())
        store = PrivateStateStore(self.spec, seq_lens, block_size=self.block_size, device=ids_T.device,
                                  buffers=buffers)
        store.bind(batch)
        return forward_hidden(self.spec, self._params(), batch, store, shard_plan=self.shard_plan,
                              dispatcher=self._dispatcher), batch

    def forward(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """Final hidden states of packed sequences.

        Args:
            input_ids: int ``[T]`` or ``[1, T]``, sequences concatenated.
            cu_seqlens: int ``[B+1]`` boundaries (default: one sequence). Tokens
                past ``cu_seqlens[-1]`` form one extra padding sequence.
            packed_seq_params: Megatron ``PackedSeqParams(qkv_format="thd")``
                instead of ``cu_seqlens`` (``cu_seqlens_q_padded`` wins when set).

        Returns:
            ``[T, D]`` (``[1, T, D]`` for ``[1, T]`` input) in ``spec.dtype``;
            row ``t`` depends only on its own sequence's tokens up to ``t``.
            Differentiable w.r.t. the parameters when grad mode is on; the
            values are the same bits either way.

        Raises:
            ParallelismError: Megatron's parallel state holds a refused layout.
            ValueError: malformed inputs.
        """
        check_current_parallel_state("UnifiedMegatronModel.forward")
        ids_T, cu, batched = self._flat_inputs(input_ids, cu_seqlens, packed_seq_params)
        hidden_TD, _ = self._hidden(ids_T, cu)
        return hidden_TD.unsqueeze(0) if batched else hidden_TD

    def token_logprobs(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                       rows: torch.Tensor | None = None, temperature: float = 1.0, *,
                       packed_seq_params: Any = None, target_ids: torch.Tensor | None = None,
                       return_full: bool = False):
        """fp32 logprobs of the next token at selected rows (the trainer's recompute).

        Row ``r`` scores token ``input_ids[r + 1]`` given its sequence's tokens
        ``..r`` (the logprob vLLM reports for the token sampled at position
        ``r + 1``), through the same LM head and logprob op as vLLM.

        Args:
            input_ids, cu_seqlens, packed_seq_params: as :meth:`forward`.
            rows: int ``[R]`` flat row indices, or bool ``[T]`` mask; default:
                every row that has a next token in its sequence.
            temperature: > 0, applied as in the rollout engine.
            target_ids: int ``[R]`` tokens to score instead of ``input_ids[r + 1]``
                (needed for a sequence's last row).
            return_full: also return the full ``[R, V]`` fp32 logprob rows.

        Returns:
            fp32 ``[R]``, or ``([R], [R, V])`` with ``return_full``; differentiable
            w.r.t. the parameters when grad mode is on (same bits either way).

        Raises:
            ValueError: a row out of range, or a sequence's last row without ``target_ids``.
        """
        hidden_RD, targets_R = self._scored_rows("token_logprobs", input_ids, cu_seqlens, rows, packed_seq_params,
                                                 target_ids)
        if return_full:
            lp_RV = forward_logprobs(self.spec, self._params(), hidden_RD, temperature)
            return gather_token_logprobs(lp_RV, targets_R), lp_RV
        return forward_token_logprobs(self.spec, self._params(), hidden_RD, targets_R, temperature)

    def token_logprobs_and_rows(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                                rows: torch.Tensor | None = None, temperature: float = 1.0, *,
                                packed_seq_params: Any = None, target_ids: torch.Tensor | None = None):
        """:meth:`token_logprobs` for a loss (the trainer's step): the ``[R]`` logprobs, formed in row chunks
        forward and backward (:func:`unified_models.forward.forward_token_logprobs`), and a function
        that forms the full ``[R, V]`` rows from the same hidden rows when a loss asks for them (the bits of
        ``token_logprobs(..., return_full=True)[1]``; their memory and LM-head GEMM only then).

        Returns:
            ``(tok_R fp32 [R], rows_fn)``, ``rows_fn()`` -> fp32 ``[R, V]`` with a graph when grad mode is on.

        Raises:
            As :meth:`token_logprobs`.
        """
        hidden_RD, targets_R = self._scored_rows("token_logprobs_and_rows", input_ids, cu_seqlens, rows,
                                                 packed_seq_params, target_ids)
        tok_R = forward_token_logprobs(self.spec, self._params(), hidden_RD, targets_R, temperature)
        return tok_R, lambda: forward_logprobs(self.spec, self._params(), hidden_RD, temperature)

    def _scored_rows(self, what: str, input_ids, cu_seqlens, rows, packed_seq_params, target_ids):
        """The backbone's hidden states at the scored rows and their target tokens: ``([R, D], [R])``
        (arguments and errors as :meth:`token_logprobs`)."""
        check_current_parallel_state(f"UnifiedMegatronModel.{what}")
        ids_T, cu, _ = self._flat_inputs(input_ids, cu_seqlens, packed_seq_params)
        t = ids_T.shape[0]
        batch_seq = FlatBatch.from_cu_seqlens(ids_T, cu).seq_idx
        has_next = torch.zeros(t, dtype=torch.bool, device=ids_T.device)
        if t > 1:
            has_next[:-1] = batch_seq[1:] == batch_seq[:-1]
        if rows is None:
            rows_R = has_next.nonzero().view(-1)
        else:
            rows = rows.to(ids_T.device)
            if rows.dtype == torch.bool:
                if rows.shape != (t,):
                    raise ValueError(f"row mask must be bool [T={t}], got {tuple(rows.shape)}")
                rows_R = rows.nonzero().view(-1)
            else:
                if rows.is_floating_point() or rows.dim() != 1:
                    raise ValueError(f"rows must be int [R] or bool [T], got {rows.dtype} {tuple(rows.shape)}")
                rows_R = rows.long()
                bad = rows_R[(rows_R < 0) | (rows_R >= t)]
                if bad.numel():
                    raise ValueError(f"rows {bad.tolist()[:5]} are outside [0, {t})")
        if target_ids is None:
            last = rows_R[~has_next[rows_R]]
            if last.numel():
                raise ValueError(f"rows {last.tolist()[:5]} are the last token of their sequence and have no "
                                 "next token; pass target_ids to score them")
            targets_R = ids_T[rows_R + 1]
        else:
            targets_R = target_ids.to(ids_T.device).reshape(-1)
            if targets_R.shape[0] != rows_R.shape[0]:
                raise ValueError(f"target_ids has {targets_R.shape[0]} entries for {rows_R.shape[0]} rows")
        hidden_TD, _ = self._hidden(ids_T, cu)
        return hidden_TD[rows_R], targets_R
