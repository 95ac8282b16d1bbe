"""Weight-version guard: a backward refuses to run on weights changed since its forward.

DESIGN.md rule 11. A gradient computed after the weights moved belongs to no
weight version, so each autograd function stamps the weights it used in its
forward and checks the stamps before its backward does any work. A stamp holds
three things, because no single one sees every kind of write:

* ``tensor._version`` of the tensor passed to the op (the Parameter): bumped
  by every in-place torch op on it (``p.add_``, ``p.copy_``, torch optimizers),
  with or without grad mode;
* the **explicit weight version** of its storage (:func:`bump_weight_version`):
  writes through ``p.data`` (Megatron's optimizer copies main weights that
  way), through another view of the same storage (DDP buffers) or by a
  kernel through a raw pointer bump no ``_version``, so whoever writes that
  way calls :func:`bump_weight_version` afterwards (or :func:`bump_on_step`
  does it after every ``optimizer.step()``);
* ``data_ptr()``: a ``p.data = other`` swap between forward and backward.

The explicit counter is keyed by ``(device, storage pointer)``, so bumping a
parameter, its ``.data`` alias or any view of its storage is the same bump; a
bump of a shared buffer (Megatron DDP's ``param_data``) invalidates every
weight in it, which is what an optimizer step over that buffer means.
Writes that do none of the above (a raw kernel write with no bump) stay
invisible: call :func:`bump_weight_version` after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

NAME_ATTR = "_um_weight_name"
"""Attribute holding a weight's name for error messages (set by :func:`name_weights`)."""

_COUNTERS: dict[tuple[str, int], int] = {}


class StaleWeightError(RuntimeError):
    """A backward would differentiate weights that changed since its forward."""


def _key(t: torch.Tensor) -> tuple[str, int]:
    return str(t.device), t.untyped_storage().data_ptr()


def _tensors(items) -> Iterable[torch.Tensor]:
    for it in items:
        if isinstance(it, torch.nn.Module):
            yield from it.parameters()
        elif isinstance(it, torch.Tensor):
            yield it
        elif isinstance(it, (list, tuple, set)) or hasattr(it, "__next__"):
            yield from _tensors(it)
        else:
            raise TypeError(f"bump_weight_version: expected tensors or modules, got {type(it).__name__}")


def weight_version(weight: torch.Tensor) -> int:
    """The explicit version of ``weight``'s storage (0 until first bumped)."""
    return _COUNTERS.get(_key(weight), 0)


def bump_weight_version(*weights) -> None:
    """Mark weights as changed, for writes that bump no ``tensor._version``.

    Call it after writing weights through ``param.data``, another view of the
    same storage, or a kernel (Megatron's optimizer step, in-place weight
    loaders). Any autograd graph built before the bump then refuses its
    backward with :class:`StaleWeightError`.

    Args:
        *weights: tensors, ``nn.Module`` s (all their parameters) or iterables of them.

    Raises:
        TypeError: an argument is none of these.
    """
    for w in _tensors(weights):
        k = _key(w)
        _COUNTERS[k] = _COUNTERS.get(k, 0) + 1


def bump_on_step(optimizer: torch.optim.Optimizer):
    """Bump every parameter of a torch ``optimizer`` after each ``step()``.

    Returns:
        The hook handle (``.remove()`` to stop).

    Raises:
        TypeError: ``optimizer`` has no ``register_step_post_hook`` (e.g. a
            Megatron ``MegatronOptimizer``: call :func:`bump_weight_version`
            on the model after its ``step()`` instead).
    """
    if not hasattr(optimizer, "register_step_post_hook"):
        raise TypeError(f"{type(optimizer).__name__} has no register_step_post_hook; call "
                        "unified_models.ops.autograd.bump_weight_version(model) after its step()")

    def hook(opt, args, kwargs):
        bump_weight_version(*(p for group in opt.param_groups for p in group["params"]))

    return optimizer.register_step_post_hook(hook)


def name_weights(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Give weights names for guard errors, e.g. ``name_weights(model.named_parameters())``."""
    for name, t in named:
        setattr(t, NAME_ATTR, name)


@dataclass(frozen=True)
class WeightStamp:
    """What a forward saw of one weight."""

    role: str
    tensor: torch.Tensor
    version: int
    counter: int
    data_ptr: int

    def describe(self) -> str:
        name = getattr(self.tensor, NAME_ATTR, None)
        what = f"{self.role} {name!r}" if name else f"{self.role} (unnamed)"
        return f"{what} {list(self.tensor.shape)} {self.tensor.dtype}"


def stamp(**weights: torch.Tensor | None) -> tuple[WeightStamp, ...]:
    """Stamp the given weights (``None`` entries are skipped)."""
    return tuple(WeightStamp(role, w, w._version, weight_version(w), w.data_ptr())
                 for role, w in weights.items() if w is not None)


def check_stamps(op: str, stamps: tuple[WeightStamp, ...]) -> None:
    """Raise :class:`StaleWeightError` if a stamped weight changed since the stamp.

    Raises:
        StaleWeightError: names the op, the weight, and which counter moved.
    """
    for s in stamps:
        t = s.tensor
        moved = []
        if t._version != s.version:
            moved.append(f"tensor version {s.version} -> {t._version}")
        counter = weight_version(t)
        if counter != s.counter:
            moved.append(f"weight version {s.counter} -> {counter}")
        if t.data_ptr() != s.data_ptr:
            moved.append("storage replaced (param.data = ...)")
        if moved:
            raise StaleWeightError(
                f"{op} backward: {s.describe()} was changed in place after the forward this backward "
                f"differentiates ({', '.join(moved)}); gradients would belong to no weight version. "
                "Run forward and backward between two weight updates (one optimizer update per step).")
