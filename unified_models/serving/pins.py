"""The vLLM server flags ``unified-models serve`` pins: which ones the user's argv touches, and the pins winning.

A pinned flag is found by the action vLLM's own parser runs for it, however it is spelled:
``--flag value``, ``--flag=value``, ``--no-flag`` (boolean flags), an alias (``-tp``, ``-pp``,
``-cc``, ``-sc``), underscores (``--logprobs_mode``, which ``FlexibleArgumentParser`` turns into
dashes), an abbreviation (``--logprobs-m``, argparse's ``allow_abbrev``), a dotted key
(``--hf-overrides.architectures``, merged by vLLM into one JSON value) or a ``--config FILE``
entry; a value equal to vLLM's default counts as given. A given pin is accepted only when the
value it parses to equals the pin's exactly; any other value is refused, naming the flag.
"""

from __future__ import annotations

import argparse
import reprlib

from ..dsl import UnifiedModelsError

PINNED_FLAGS = {
    "logprobs_mode": ("--logprobs-mode", "returned logprobs are our logprob op's output"),
    "hf_overrides": ("--hf-overrides", "our model class, and ModelOpt's quantization_config kept away from vLLM"),
    "model_impl": ("--model-impl", "our model class"),
    "dtype": ("--dtype", "the spec's dtype"),
    "tensor_parallel_size": ("--tensor-parallel-size", "TP = PP = 1"),
    "pipeline_parallel_size": ("--pipeline-parallel-size", "TP = PP = 1"),
    "enforce_eager": ("--enforce-eager", "the engine's graph settings"),
    "compilation_config": ("--compilation-config", "the engine's graph settings"),
    "speculative_config": ("--speculative-config", "no speculative decoding"),
    "spec_method": ("--spec-method", "no speculative decoding"),
    "spec_model": ("--spec-model", "no speculative decoding"),
    "spec_tokens": ("--spec-tokens", "no speculative decoding"),
    "model": ("--model", "the checkpoint is serve's --model DIR or --preset NAME"),
    "worker_extension_cls": ("--worker-extension-cls", "the worker answering the contract fingerprint route"),
}
"""vLLM server options ``serve`` sets itself: Namespace field -> (flag, why it is pinned)."""

_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60


def user_flags(parser: argparse.ArgumentParser, user_args: list[str]) -> tuple[set[str], argparse.Namespace]:
    """``(fields, namespace)``: the Namespace fields that ``user_args`` set, at any value (vLLM's default
    included), and ``user_args`` parsed alone (the values the user gave, whatever ours would override).

    A field is set when vLLM's parser ran one of its actions on ``user_args`` alone (argparse's
    ``_get_values`` is called once per action taken, before the action), so every spelling the
    parser accepts counts (see the module doc). The positional ``model_tag`` (which argparse runs on
    every parse, with ``None``) counts only with a value.

    Raises:
        whatever ``parser.parse_args`` raises (``SystemExit``, or vLLM's own pre-parsing errors).
    """
    ran: list[argparse.Action] = []
    get_values = parser._get_values

    def record(action, arg_strings):
        ran.append(action)
        return get_values(action, arg_strings)

    parser._get_values = record
    try:
        ns = parser.parse_args(list(user_args))
    finally:
        del parser._get_values
    fields = {a.dest for a in ran if a.dest != "model_tag"} | ({"model_tag"} if ns.model_tag is not None else set())
    return fields, ns


def _as_flag(flag: str, value) -> str:
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {_short.repr(value)}"


def apply_pins(parser: argparse.ArgumentParser, ns: argparse.Namespace, pinned: argparse.Namespace,
               given: set[str], user: argparse.Namespace) -> None:
    """Set every pinned field of ``ns`` (ours then the user's flags, parsed) to ``pinned``'s (ours alone).

    Args:
        parser: vLLM's server parser (for its defaults, named in the error).
        ns: the namespace parsed from our flags followed by the user's; changed in place.
        pinned: the namespace parsed from our flags alone.
        given, user: the fields the user's flags set and those flags parsed alone (:func:`user_flags`;
            alone because a ``--config FILE`` entry ranks below our flags in ``ns``).

    Raises:
        UnifiedModelsError: one line naming every pinned flag in ``given`` whose value differs
            from the pin, with the pin and why it is pinned.
    """
    clash = []
    for field in sorted(given & PINNED_FLAGS.keys()):
        flag, why = PINNED_FLAGS[field]
        want = getattr(pinned, field)
        if getattr(user, field) == want:
            continue
        if want is None:
            pin = f"leaves {flag} unset"
        elif isinstance(want, (bool, int, float, str, dict, list)) or want != parser.get_default(field):
            pin = f"pins {_as_flag(flag, want)}"
        else:  # a config object (the CPU's --compilation-config)
            pin = f"leaves {flag} at vLLM's default"
        clash.append(f"{_as_flag(flag, getattr(user, field))} given, serve {pin} ({why})")
    if clash:
        raise UnifiedModelsError(f"vLLM server flags would undo serve's pins: {'; '.join(clash)}; pass a pinned "
                                 "flag only with the pinned value, or not at all")
    for field in PINNED_FLAGS:
        setattr(ns, field, getattr(pinned, field))
