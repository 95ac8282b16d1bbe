"""Plugins: registrations made from outside the package, visible to the command line.

A plugin is a Python module whose import (or a callable it names) registers what the
package does not ship: a transformers config class, a layer family
(:func:`unified_models.layers.register_family`), a residual policy, a model
declaration (:func:`unified_models.models.register_model`), a reward
(:func:`unified_models.rl.rewards.register_reward`). Registrations live in the
process, so the ``unified-models`` command imports plugins itself, before it
parses the rest of the command line:

* every entry point of the :data:`ENTRY_POINT_GROUP` group of the installed
  distributions (``[project.entry-points."unified_models.plugins"]`` in a
  ``pyproject.toml``, ``toy = "my_pkg.unified_plugin"`` or
  ``toy = "my_pkg.unified_plugin:register"``); a module is imported, a callable is
  then called with no arguments;
* each ``--plugin MODULE`` (repeatable), imported by its dotted name, in order.

Each plugin is loaded at most once per process.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Iterable

from .dsl import UnifiedModelsError

__all__ = ["ENTRY_POINT_GROUP", "OVERRIDE_NATIVE_ENV", "load_entry_point_plugins", "import_plugin_modules",
           "load_plugins", "override_native_enabled"]

ENTRY_POINT_GROUP = "unified_models.plugins"
"""The ``importlib.metadata`` entry-point group read at CLI start."""

OVERRIDE_NATIVE_ENV = "UNIFIED_MODELS_OVERRIDE_NATIVE"
"""Set to ``1`` and plain vLLM (``python -m vllm.entrypoints.openai.api_server --model DIR``,
``AsyncLLM``, ``vllm.LLM``) loads checkpoints of our families (``NemotronHForCausalLM``,
``DeepseekV4ForCausalLM``) with our model class, without ``--hf-overrides``; read by vLLM's
plugin entry point (:func:`unified_models.backends.vllm.plugin.register`)."""


def override_native_enabled() -> bool:
    """True when :data:`OVERRIDE_NATIVE_ENV` is ``1`` / ``true`` / ``yes`` / ``on``.

    Raises:
        UnifiedModelsError: any other non-empty value (``0``/``false``/``no``/``off`` mean off).
    """
    import os

    v = os.environ.get(OVERRIDE_NATIVE_ENV, "").strip().lower()
    if v in ("", "0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise UnifiedModelsError(f"{OVERRIDE_NATIVE_ENV}={os.environ[OVERRIDE_NATIVE_ENV]!r}: expected 1 or 0")

_loaded: set[str] = set()
"""Entry points (``group:name=value``) and modules already loaded in this process."""


def load_entry_point_plugins() -> list[str]:
    """Load every :data:`ENTRY_POINT_GROUP` entry point not loaded yet.

    Returns:
        The entry points loaded by this call, as ``name = value``.

    Raises:
        UnifiedModelsError: an entry point cannot be imported or its callable fails;
            the message names the entry point and its distribution.
    """
    done = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"{ENTRY_POINT_GROUP}:{ep.name}={ep.value}"
        if key in _loaded:
            continue
        dist = getattr(getattr(ep, "dist", None), "name", None) or "?"
        try:
            obj = ep.load()
            if callable(obj):
                obj()
        except Exception as e:  # noqa: BLE001 - any failure of foreign code is reported as a plugin error
            raise UnifiedModelsError(f"plugin entry point {ep.name!r} = {ep.value!r} (group {ENTRY_POINT_GROUP}, "
                                     f"distribution {dist}) failed to load: {type(e).__name__}: {e}") from e
        _loaded.add(key)
        done.append(f"{ep.name} = {ep.value}")
    return done


def import_plugin_modules(modules: Iterable[str]) -> list[str]:
    """Import each dotted module name (``--plugin MODULE``) in order, once per process.

    Returns:
        The modules imported by this call.

    Raises:
        UnifiedModelsError: a module cannot be found or raises while importing; the
            message names it.
    """
    done = []
    for name in modules:
        if name in _loaded:
            continue
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as e:
            raise UnifiedModelsError(f"--plugin {name}: no module named {e.name!r} (is it installed, or on "
                                     "PYTHONPATH?)") from e
        except Exception as e:  # noqa: BLE001
            raise UnifiedModelsError(f"--plugin {name}: importing it failed: {type(e).__name__}: {e}") from e
        _loaded.add(name)
        done.append(name)
    return done


def load_plugins(modules: Iterable[str] = ()) -> list[str]:
    """Entry-point plugins, then ``modules``; returns what this call loaded (see above)."""
    return load_entry_point_plugins() + import_plugin_modules(modules)
