"""Weight loading of the vLLM model class: vLLM's streaming load and the trainer's in-place sync.

:class:`WeightLoading` is a mixin of :class:`~.model.UnifiedForCausalLM` (it uses the
model's ``params()``, ``invalidate_params()``, ``_shapes``/``_dtypes`` from the spec,
``_source`` and ``_initial_load_done``): :meth:`~WeightLoading.load_weights` is vLLM's
loader entry point; :meth:`~WeightLoading.prepare_weights` then
:meth:`~WeightLoading.copy_weights` are the validated-once, cast-once in-place update
that :mod:`.weight_sync` drives (DESIGN.md rule 10: storage and ``data_ptr`` kept).

Expert parallelism (rollout EP > 1): the model holds only its rank's routed experts. Every
entry point accepts a full HF state dict (the tensors of experts other EP ranks hold are
checked for shape and code dtype, then skipped) or one with only this rank's experts (what
a trainer at the same EP layout holds); names no rank holds and mis-shaped tensors are still
refused. "Every parameter" (the first load, ``strict`` updates) means every parameter held here.
"""

from __future__ import annotations

from typing import Iterable, Mapping

import torch
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from ...dsl import CheckpointError


class WeightLoading:
    """Loading and in-place updating of the model's parameters (see the module docstring)."""

    @property
    def foreign_experts(self) -> Mapping[str, tuple[int, ...]]:
        """HF name -> shape of the routed-expert tensors other expert-parallel ranks hold (empty at
        EP = 1): accepted by every load and sync, and skipped."""
        return getattr(self, "_foreign_experts", {})

    def held_shapes(self) -> Mapping[str, tuple[int, ...]]:
        """HF name -> shape of every parameter this model holds (the spec's, less :attr:`foreign_experts`)."""
        return self._shapes

    def weight_table_problems(self, expected: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]], *,
                              require_all: bool) -> list[str]:
        """``converters.hf_safetensors.tensor_table_problems`` of ``got`` against ``expected`` (tensors
        held here), where the names of :attr:`foreign_experts` are neither unexpected nor required but
        must have their spec shape."""
        from ...converters.hf_safetensors import tensor_table_problems

        foreign = self.foreign_experts
        problems = tensor_table_problems(dict(expected), {n: s for n, s in got.items() if n not in foreign},
                                         require_all=require_all)
        shaped = [f"{n}: expected {foreign[n]}, got {tuple(s)}" for n, s in got.items()
                  if n in foreign and tuple(s) != tuple(foreign[n])]
        if shaped:
            problems.append(f"mis-shaped tensors (experts other expert-parallel ranks hold): {shaped}")
        return problems

    def _weight_problem(self, name: str, tensor: torch.Tensor) -> str | None:
        """What is wrong with ``tensor`` as parameter ``name`` (held here or by another expert-parallel
        rank) before any value is read (shape, code dtype), or None; an unknown name is the caller's
        to report."""
        foreign = name not in self._shapes
        expected = self._foreign_experts[name] if foreign else self._shapes[name]
        if tuple(tensor.shape) != expected:
            return f"tensor {name} has shape {tuple(tensor.shape)}, the spec expects {expected}"
        want = self._foreign_dtypes[name] if foreign else self._dtypes[name]
        if want == torch.float8_e8m0fnu and tensor.is_floating_point() and tensor.dtype not in _CODE_DTYPES:
            # a power-of-two scale stored in another float dtype: read exactly, as every other load
            # does (``converters.hf_safetensors.cast_to_stored_dtypes``); any other value is refused
            from ...converters.hf_safetensors import e8m0_cast_problem

            return e8m0_cast_problem(name, tensor)
        if (want in _CODE_DTYPES or tensor.dtype in _CODE_DTYPES) and tensor.dtype != want:
            return f"tensor {name} has dtype {tensor.dtype}, the spec stores {want}"
        if want.is_floating_point and not tensor.is_floating_point():  # int / bool for a weight: corruption
            return f"tensor {name} has dtype {tensor.dtype}, the spec stores a floating-point {want}"
        return None

    def _checkpoint_layout(self):
        """The layout module of the checkpoint directory vLLM loads (:func:`~unified_models.converters.
        hf_safetensors.checkpoint_layout`), or None for a canonical one (or no directory)."""
        import json
        from pathlib import Path

        from ...converters.hf_safetensors import checkpoint_layout

        try:
            raw = json.loads((Path(self._source) / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return checkpoint_layout(raw)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load ``(HF name, tensor)`` pairs through each parameter's ``weight_loader`` (vLLM's
        loader path: the pairs stream from the checkpoint, each validated as it arrives).

        The first call (vLLM's initial load) must cover every parameter held here; later
        calls (vLLM's ``reload_weights``, weight-transfer engines) may load a subset. At EP > 1
        the tensors of experts other ranks hold are checked (shape, code dtype) and skipped.
        In-place updates from a trainer go through :meth:`prepare_weights` and
        :meth:`copy_weights` instead (all validated before anything is written).

        Returns:
            The set of loaded parameter names.

        Raises:
            CheckpointError: unknown name, wrong shape, NaN/Inf values, or (first
                call) missing tensors; every offending name is listed.
        """
        params = self.params()
        loaded: set[str] = set()
        unknown: list[str] = []
        layout = self._checkpoint_layout()
        if layout is not None:  # e.g. DeepSeek's published layout: canonical names, tensor by tensor
            weights = layout.official_stream_to_canonical(
                weights, lambda lin: f"{lin}{layout.MXFP4_SCALE}" in self._shapes)
        from ...converters.hf_safetensors import expert_id_problem, expert_id_tables

        id_tables = expert_id_tables(self.spec)
        try:
            foreign = self.foreign_experts
            for name, tensor in weights:
                if name not in self._shapes and name not in foreign:
                    unknown.append(name)
                    continue
                problem = self._weight_problem(name, tensor)
                if problem is not None:
                    raise CheckpointError(f"checkpoint {self._source}: {problem}")
                if name in foreign:  # another expert-parallel rank's expert
                    continue
                if (tensor.dtype not in _CODE_DTYPES and tensor.is_floating_point()
                        and not bool(torch.isfinite(tensor).all())):
                    raise CheckpointError(f"checkpoint {self._source}: tensor {name} holds NaN or Inf")
                if name in id_tables:  # routed-expert ids (hash routing): an id past the experts is corrupt
                    problem = expert_id_problem(name, tensor, id_tables[name])
                    if problem is not None:
                        raise CheckpointError(f"checkpoint {self._source}: {problem}")
                param = params[name]
                if param.dtype == torch.float8_e8m0fnu and tensor.dtype != param.dtype:
                    tensor = tensor.to(param.dtype)  # exact: _weight_problem refused any other value
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                loaded.add(name)
        finally:
            self.invalidate_params()
        if unknown:
            raise CheckpointError(
                f"checkpoint {self._source} has tensors the {self.spec.family} spec does not declare: "
                f"{sorted(unknown)}")
        self._after_copy(loaded)
        return loaded

    def prepare_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *, skip_unchanged: bool = False,
                        what: str = "in-place weight update") -> tuple[dict[str, torch.Tensor], list[str]]:
        """Validate new values of parameters once, cast once, without copying anything.

        Each tensor is checked for its name, shape and (quantized codes) dtype (at EP > 1 the
        tensors of experts other ranks hold are checked so and left out), cast once
        to its parameter's device and dtype (``Tensor.to``: round to nearest even; a no-op
        when both already match). With ``skip_unchanged`` it is first compared bit for bit
        with the parameter (equal ones are left out: the parameter was validated when it
        was loaded); every other float tensor is checked for NaN/Inf after the cast. The
        equality flags, then the finiteness flags, of all tensors are gathered on the
        device and read with one host sync each (on the CPU, where there is no sync to
        save, the comparisons are ``torch.equal`` on the bits).

        Args:
            weights: ``(HF name, tensor)`` pairs, any device, shapes as the spec declares.
            skip_unchanged: leave out tensors whose bits already equal the parameter's.
            what: how error messages name the operation.

        Returns:
            ``(changed, unchanged)``: ``{name: cast tensor}`` to pass to :meth:`copy_weights`
            (in the order given) and the names left out because they are equal.

        Raises:
            CheckpointError: unknown names, wrong shapes or code dtypes (all listed
                together), then NaN/Inf after the cast (all listed); nothing is written.
        """
        params = self.params()
        problems: list[str] = []
        unknown: list[str] = []
        cast: dict[str, torch.Tensor] = {}
        foreign = self.foreign_experts
        for name, tensor in weights:
            if name not in self._shapes and name not in foreign:
                unknown.append(name)
                continue
            problem = self._weight_problem(name, tensor)
            if problem is not None:
                problems.append(problem)
                continue
            if name in foreign:  # another expert-parallel rank's expert: validated, not held here
                continue
            p = params[name]
            cast[name] = tensor.detach().to(device=p.device, dtype=p.dtype)
        if unknown:
            problems.append(f"the {self.spec.family} spec does not declare {sorted(unknown)}")
        if problems:
            raise CheckpointError(f"{what} rejected ({self._source}): " + "; ".join(problems))
        names = list(cast)
        unchanged: list[str] = []
        if skip_unchanged:  # one host sync for all comparisons
            same = _flags([_bits_equal(cast[n], params[n]) for n in names])
            unchanged = [n for n, eq in zip(names, same) if eq]
            names = [n for n, eq in zip(names, same) if not eq]
        finite_names = [n for n in names if cast[n].dtype not in _CODE_DTYPES and cast[n].is_floating_point()]
        ok = _flags([torch.isfinite(cast[n]).all() for n in finite_names])  # one host sync for all tensors
        bad = [n for n, good in zip(finite_names, ok) if not good]
        if bad:
            raise CheckpointError(f"{what} rejected: tensors {bad} hold NaN or Inf (after the cast to the "
                                  "engine's dtypes)")
        return {n: cast[n] for n in names}, unchanged

    def copy_weights(self, prepared: Mapping[str, torch.Tensor]) -> set[str]:
        """Copy tensors from :meth:`prepare_weights` into their parameters through each
        parameter's ``weight_loader`` (``param.data.copy_``: storage and ``data_ptr`` kept).

        Returns:
            The set of copied names.

        Raises:
            CheckpointError: (the first load, when vLLM started on dummy weights) tensors
                missing; quantized checkpoints: bad scales after the copy.
        """
        params = self.params()
        try:
            with torch.no_grad():
                for name, tensor in prepared.items():
                    param = params[name]
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
        finally:
            self.invalidate_params()
        loaded = set(prepared)
        self._after_copy(loaded)
        return loaded

    def _after_copy(self, loaded: set[str]) -> None:
        if not self._initial_load_done:
            missing = [n for n in self._shapes if n not in loaded]
            if missing:
                raise CheckpointError(
                    f"checkpoint {self._source} is missing tensors of the {self.spec.family} spec: {missing}")
            self._initial_load_done = True
            self._compile_logits_kernels()
        if any(d != self.spec.dtype for d in self._dtypes.values()):
            from ...converters.modelopt import validate_quantized

            validate_quantized(self.params(), self.spec, source=str(self._source), absent=self.foreign_experts)


_CODE_DTYPES = (torch.uint8, torch.float8_e4m3fn, torch.float8_e8m0fnu)
"""Stored dtypes of quantized codes and power-of-two scales: never cast, never NaN-checked as floats."""
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | bool:
    """Whether ``a`` and ``b`` (same shape, dtype and device) hold the same bits (unlike ``==``,
    +0 and -0 differ and equal NaNs match): a 0-dim bool tensor on an accelerator (read later
    with the others, :func:`_flags`), a bool on the CPU (``torch.equal`` stops at the first
    difference; the CPU has no host sync to save)."""
    as_int = _SAME_SIZE_INT[a.element_size()]
    if a.device.type == "cpu":
        return torch.equal(a.view(as_int), b.view(as_int))
    return torch.eq(a.view(as_int), b.view(as_int)).all()


def _flags(values: list) -> list[bool]:
    """``bool`` of each 0-dim bool tensor / bool, with one host sync for all tensors of a device."""
    out: list = list(values)
    by_device: dict[torch.device, list[int]] = {}
    for i, v in enumerate(out):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([out[i] for i in idx]).tolist()):
            out[i] = v
    return [bool(v) for v in out]
