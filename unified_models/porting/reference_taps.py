"""The reference sides of ``bisect``: our oracle forward and transformers' modules, as tap recordings.

* :func:`reference_on_engine_inputs`: each sublayer's oracle (fp32/fp64) on the
  engine's own recorded input, so the error of one sublayer is measured alone;
* :func:`peer_recordings`: our fp32 reference forward and transformers' model on the
  same tokens and weights, with the outputs of the modules that compute our taps
  (forward hooks on transformers' modules, found by their HF names as the family maps them:
  :func:`peer_module_names`); the taps no transformers module outputs: :func:`peer_not_comparable`.

Tap names: :func:`sublayer_tap_names` (``embedding``, each sublayer's ``<norm>``,
``<mixer>``, ``<mixer>.residual``, ``final_norm``, ``logits``).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Mapping

import torch

from .taps import TapRecorder, TapRecords, tap_name

__all__ = ["sublayer_tap_names", "required_tap_names", "reference_on_engine_inputs", "peer_recordings",
           "peer_module_names", "peer_not_comparable"]


def sublayer_tap_names(spec) -> list[str]:
    """The tap names every family has, in forward order."""
    out = ["embedding"]
    for sub in spec.sublayers:
        out += [tap_name(sub.norm.name), tap_name(sub.mixer.name), tap_name(sub.mixer.name) + ".residual"]
    return out + ["final_norm", "logits"]


def _batch(seq: int, n: int):
    return SimpleNamespace(seq_idx=torch.full((n,), seq, dtype=torch.int32), positions=torch.arange(n))


def _seq_rows(records: TapRecords, name: str, seq: int) -> torch.Tensor | None:
    rows = records.rows(name)
    keys = sorted(p for s, p in rows if s == seq)
    if not keys or keys != list(range(len(keys))):
        return None
    return torch.stack([rows[(seq, p)] for p in keys])


def _reference(spec, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype):
    from ..backends.reference import ReferenceModel

    ref = ReferenceModel(spec, dtype=dtype)
    ref.load_state_dict_hf(state_dict)
    return ref


def reference_on_engine_inputs(spec, state_dict: Mapping[str, torch.Tensor], engine: TapRecords, *,
                               dtype: torch.dtype = torch.float64, recorder: TapRecorder | None = None,
                               tokens: dict[int, list[int]] | None = None) -> TapRecorder:
    """Each sublayer's oracle on the engine's input rows, recorded under the engine's tap names.

    Args:
        spec, state_dict: the model (master weights).
        engine: the engine's recording (sublayer-level taps of whole sequences from position 0).
        dtype: the reference's dtype (fp32 or fp64).
        recorder: where to record (default a fresh :class:`~.taps.TapRecorder`).
        tokens: sequence -> token ids, for the embedding (default: not compared).

    Returns:
        The recorder. ``norm`` / ``residual`` rows are recomputed only where the engine
        recorded the stream (a plain residual; hyper-connection streams are not tensors). Rows
        where a family's oracle makes a top-k choice within the engine's rounding
        (``LayerFamily.oracle_near_ties``) are recorded as excused (:attr:`.taps.TapRecords.excused`).
    """
    from ..layers import family_of, residual_policy
    from ..layers.oracle import NEAR_TIE_ROUNDINGS, rms_norm_oracle
    from ..layers.residual import PlainResidual

    rec = recorder or TapRecorder()
    ref = _reference(spec, state_dict, dtype)
    params = ref.hf_params()
    policy, rspec = residual_policy(spec.residual, oracle=True), spec.residual
    plain = isinstance(policy, PlainResidual)  # mHC streams are not the recorded tensors: mixers only
    seqs = sorted({s for keys, _ in engine.chunks.get(tap_name(spec.sublayers[0].norm.name), []) for s in keys[:, 0].tolist()})
    with torch.no_grad():
        for s in seqs:
            x_in = _seq_rows(engine, tap_name(spec.sublayers[0].norm.name), s)
            if x_in is None:
                continue
            rec.begin(_batch(s, x_in.shape[0]))
            if tokens is not None and s in tokens:
                rec("embedding", params[spec.embedding.name + ".weight"][torch.tensor(tokens[s])])
            stream = _seq_rows(engine, "embedding", s) if plain else None
            for sub in spec.sublayers:
                norm, mixer = tap_name(sub.norm.name), tap_name(sub.mixer.name)
                x = _seq_rows(engine, norm, s)
                if stream is not None:
                    rec(norm, rms_norm_oracle(policy.sublayer_input(rspec, params, stream.to(dtype), sub),
                                              params[sub.norm.name + ".weight"], sub.norm.eps))
                fam = family_of(sub.mixer, sub.index)
                extra = {"input_ids_T": torch.tensor(tokens[s])} if fam.oracle_takes_input_ids and tokens else {}
                if fam.oracle_takes_input_ids and not extra:
                    y = None
                else:
                    y = rec(mixer, fam.oracle(sub.mixer, params, x.to(dtype), **extra))
                    if fam.oracle_near_ties is not None and mixer in engine.dtypes:
                        near = fam.oracle_near_ties(sub.mixer, params, x.to(dtype), engine.dtypes[mixer])
                        why = ("near tie: a top-k decided within the engine's rounding of its scores "
                               f"({NEAR_TIE_ROUNDINGS} eps of their dtype, relative)")
                        rec.records.excused.setdefault(mixer, {}).update(
                            {(s, int(p)): why for p in near.nonzero().flatten().tolist()})
                y_engine = _seq_rows(engine, mixer, s)
                after = _seq_rows(engine, mixer + ".residual", s)
                if stream is not None and after is not None and y_engine is not None:
                    rec(mixer + ".residual", policy.add(rspec, params, stream.to(dtype), sub, y_engine.to(dtype)))
                stream = after if plain else None
            if stream is not None:
                rec("final_norm", rms_norm_oracle(policy.contract(rspec, params, stream.to(dtype)),
                                                  params[spec.final_norm.name + ".weight"], spec.final_norm.eps))
            h = _seq_rows(engine, "final_norm", s)
            if h is not None:
                rec("logits", h.to(dtype) @ params[spec.lm_head.weight_name].t())
    return rec


def required_tap_names(spec) -> list[str]:
    """The ops every bisect must compare before it may say "no divergent op": each sublayer's mixer
    (every layer's attention, MoE, MLP, Mamba ...) and ``logits``."""
    return [tap_name(sub.mixer.name) for sub in spec.sublayers] + ["logits"]


def peer_module_names(spec) -> dict[str, str]:
    """transformers module name (in memory) -> our tap name, for the taps a transformers module outputs:
    the embedding, each sublayer's norm and mixer, each decoder block's output (the stream after its
    last sublayer, under a plain residual), the final norm and the LM head (``logits``).

    The spec's names are mapped by the family's ``transformers_module_name``
    (:func:`unified_models.models.transformers_module_name`: transformers may rename modules at load
    time, DeepSeek-V4's ``attn`` -> ``self_attn`` ...)."""
    from ..layers import residual_policy
    from ..layers.residual import PlainResidual
    from ..models import transformers_module_name

    def hf(name: str) -> str:
        return transformers_module_name(spec, name)

    out = {hf(spec.embedding.name): "embedding"}
    plain = isinstance(residual_policy(spec.residual, oracle=True), PlainResidual)
    for sub in spec.sublayers:
        out[hf(sub.norm.name)] = tap_name(sub.norm.name)
        out[hf(sub.mixer.name)] = tap_name(sub.mixer.name)
        if plain:  # a decoder block's output is the stream after its last sublayer (the last one wins)
            out[hf(sub.mixer.name.rsplit(".", 1)[0])] = tap_name(sub.mixer.name) + ".residual"
    out[hf(spec.final_norm.name)] = "final_norm"
    out[hf(spec.lm_head.name)] = "logits"  # the head module (its weight may be tied to the embedding's)
    return out


def peer_not_comparable(spec) -> dict[str, str]:
    """Our tap name -> why no transformers module outputs that tensor, for the taps of
    :func:`sublayer_tap_names` that ``--against peer`` cannot compare: the residual stream after a
    sublayer that is not its decoder block's last (inside the block's forward, no module's output) and,
    under a residual of several streams (mHC), every residual tap (the streams are the residual
    policy's state, not one tapped tensor; their effect is compared at the next sublayer's norm)."""
    from ..layers import residual_policy
    from ..layers.residual import PlainResidual

    plain = isinstance(residual_policy(spec.residual, oracle=True), PlainResidual)
    out: dict[str, str] = {}
    for block in spec.blocks:
        for j, sub in enumerate(block.sublayers):
            name = tap_name(sub.mixer.name) + ".residual"
            if not plain:
                out[name] = (f"{type(spec.residual).__name__} residual: several streams held by the residual "
                             "policy, no one tensor to tap; compared through the next norm's input")
            elif j < len(block.sublayers) - 1:
                out[name] = "the stream between two sublayers of one decoder block: no transformers module outputs it"
    return out


def _reference_forward(ref, ids: torch.Tensor, rec: TapRecorder) -> None:
    """Our reference forward of one sequence (as ``ReferenceModel.logits``) with sublayer taps."""
    from ..layers import family_of, residual_policy
    from ..layers.oracle import rms_norm_oracle

    s, params = ref.spec, ref.hf_params()
    policy = residual_policy(s.residual, oracle=True)
    h = rec("embedding", ref.p(s.embedding.name + ".weight")[ids.long()])
    r = policy.expand(s.residual, params, h)
    for sub in s.sublayers:
        x = rec(tap_name(sub.norm.name), rms_norm_oracle(policy.sublayer_input(s.residual, params, r, sub),
                                                          ref.p(sub.norm.name + ".weight"), sub.norm.eps))
        fam = family_of(sub.mixer, sub.index)
        extra = {"input_ids_T": ids} if fam.oracle_takes_input_ids else {}
        y = rec(tap_name(sub.mixer.name), fam.oracle(sub.mixer, params, x, **extra))
        r = policy.add(s.residual, params, r, sub, y)
        rec(tap_name(sub.mixer.name) + ".residual", r)
    h = rec("final_norm", rms_norm_oracle(policy.contract(s.residual, params, r), ref.p(s.final_norm.name + ".weight"),
                                          s.final_norm.eps))
    rec("logits", h @ ref.p(s.lm_head.weight_name).t())


def peer_recordings(spec, state_dict: Mapping[str, torch.Tensor], hf_config, prompt_ids: list[list[int]], *,
                    ours: TapRecorder | None = None, theirs: TapRecorder | None = None
                    ) -> tuple[TapRecorder, TapRecorder]:
    """Our fp32 reference and transformers' model (fp32, single-threaded, as ``check``'s peer)
    on each prompt, recorded under our tap names.

    Raises:
        UnifiedModelsError: transformers has no causal-LM class for the config.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from ..dsl import UnifiedModelsError

    ours, theirs = ours or TapRecorder(), theirs or TapRecorder()
    ref = _reference(spec, state_dict, torch.float32)
    hf_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(hf_config), None)
    if hf_class is None:
        raise UnifiedModelsError(f"bisect --against peer: transformers has no causal-LM class for "
                                 f"{type(hf_config).__name__}")
    hf = hf_class.from_pretrained(None, config=hf_config, state_dict=dict(state_dict), dtype=torch.float32).eval()
    # transformers may name its modules under another root than the checkpoint (``model.`` for
    # ``backbone.``): match without the root
    modules = {tap_name(m): mod for m, mod in hf.named_modules()}
    names = {tap_name(m): n for m, n in peer_module_names(spec).items() if tap_name(m) in modules}

    def hook(name):
        def f(_mod, _args, out):
            t = out[0] if isinstance(out, (tuple, list)) else getattr(out, "logits", out)
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == 1:
                theirs(name, t[0].float())
        return f

    handles = [modules[m].register_forward_hook(hook(n)) for m, n in names.items()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            for i, ids in enumerate(prompt_ids):
                x = torch.tensor(ids)
                ours.begin(_batch(i, len(ids)))
                _reference_forward(ref, x, ours)
                theirs.begin(_batch(i, len(ids)))
                hf(x[None])
    finally:
        torch.set_num_threads(threads)
        for h in handles:
            h.remove()
    return ours, theirs
