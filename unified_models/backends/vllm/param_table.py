"""Parameter tables of the vLLM model class that count their changes.

vLLM (and weight-transfer engines) may re-register a parameter under an existing name;
the model caches its ``{HF name: parameter}`` dict (:meth:`~.model.UnifiedForCausalLM.params`)
and must rebuild it then. Every submodule that owns parameters is a :class:`Node` whose
``_parameters`` table is a :class:`ParamTable`: any write bumps a shared generation counter.
"""

from __future__ import annotations

from torch import nn


class ParamTable(dict):
    """A module's ``_parameters`` table that counts its changes in a shared ``[generation]``
    list, so :meth:`~.model.UnifiedForCausalLM.params` knows when to rebuild its cached dict.

    Every way of (re-)registering or removing a parameter ends here: ``register_parameter``,
    ``setattr(module, name, Parameter)``, ``module._parameters[name] = p``, ``del``, ``Module._apply``.
    """

    def __init__(self, generation: list[int]):
        super().__init__()
        self._generation = generation

    def _changed(self) -> None:
        gen = getattr(self, "_generation", None)  # absent on a copy made without __init__
        if gen is not None:
            gen[0] += 1

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def pop(self, *args):
        self._changed()
        return super().pop(*args)

    def popitem(self):
        self._changed()
        return super().popitem()

    def clear(self):
        self._changed()
        super().clear()

    def update(self, *args, **kwargs):
        self._changed()
        super().update(*args, **kwargs)

    def setdefault(self, key, default=None):
        self._changed()
        return super().setdefault(key, default)


class Node(nn.Module):
    """A plain container so parameters sit under their Hugging Face names; its parameter
    table is a :class:`ParamTable` counting into the model's ``generation``."""

    def __init__(self, generation: list[int]):
        super().__init__()
        self.__dict__["_parameters"] = ParamTable(generation)


def submodule(root: nn.Module, path: list[str], generation: list[int]) -> nn.Module:
    """The :class:`Node` at ``path`` under ``root`` (HF name parts), created on the way with
    tables counting into ``generation``."""
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = Node(generation)
            mod.add_module(part, child)
        mod = child
    return mod
