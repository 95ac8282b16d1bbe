"""Residual-stream policy specs: how sublayer outputs enter the residual stream.

The forward (:func:`unified_models.forward.forward_hidden`) keeps an opaque
residual *state* and asks the model's policy, for each sublayer, for its input
(``pre``) and how its output folds back (``post``); ``expand`` builds the state
from the embedding and ``contract`` reduces it before the final norm. The
computation of each policy lives in :mod:`unified_models.layers.residual`
(registered by spec type, as the layer families are).

* :class:`PlainResidualSpec`: one stream in the model dtype, ``h = h + y``
  (one IEEE rounding of the exact sum per sublayer; Nemotron-H, Llama, ...).
* :class:`HyperConnectionSpec`: mHC with n streams (DeepSeek-V4: expand after
  the embedding, pre/post/Sinkhorn-residual mixing per sublayer, ``hc_head``
  before the final norm); its parameters are transformers' names and shapes.
  ``tests/test_family_protocol.py`` defines a toy 2-stream policy through the
  same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import SpecError


@dataclass(frozen=True, kw_only=True)
class PlainResidualSpec:
    """One residual stream in the model dtype: ``h = h + mixer(norm(h))`` per sublayer. No parameters."""

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        return {}


PLAIN_RESIDUAL = PlainResidualSpec()
"""The default policy of :class:`~unified_models.dsl.ModelSpec`."""


@dataclass(frozen=True, kw_only=True)
class HyperConnectionSpec:
    """Manifold-constrained hyper-connections (mHC, DeepSeek-V4): ``hc_mult`` residual streams.

    The state is ``[T, n, D]`` (n = ``hc_mult``), in the model dtype. ``expand`` copies
    the embedding into the n streams; before each sublayer an HC *pre* computes, from
    the RMS-normalised flattened streams, the collapse weights ``pre [n]``, the expand
    weights ``post [n]`` and the Sinkhorn-normalised stream mix ``comb [n, n]``
    (fp32, ``sinkhorn_iters`` iterations); the sublayer reads ``sum_j pre_j h_j``; its
    output ``y`` goes back as ``h'_k = post_k y + sum_j comb[j, k] h_j``; ``hc_head``
    collapses the streams into one before the final norm. Formulas: transformers 5.19
    ``models/deepseek_v4/modeling_deepseek_v4.py`` (``DeepseekV4HyperConnection``,
    ``DeepseekV4HyperHead``, ``DeepseekV4DecoderLayer.forward``, ``DeepseekV4Model.forward``);
    paper: Xie et al., "mHC: Manifold-Constrained Hyper-Connections", arXiv 2512.24880.
    The computation is :mod:`unified_models.ops.mhc`.

    Parameters (transformers' names; ``M = (2 + n) n`` mixing logits):

    * per sublayer, under its HC name ``p`` (``model.layers.{i}.hc_attn`` and
      ``model.layers.{i}.hc_ffn`` in DeepSeek-V4's checkpoints, as transformers'
      ``save_pretrained`` and the published layout write them): ``p_fn [M, n D]``,
      ``p_base [M]``, ``p_scale [3]`` (pre, post, comb scales);
    * the head, under ``head_name`` (``model.hc_head``): ``hc_fn [n, n D]``,
      ``hc_base [n]``, ``hc_scale [1]``.

    Fields:
        hc_mult: n, the number of streams (config ``hc_mult``).
        hidden_size: D.
        sinkhorn_iters: Sinkhorn iterations (config ``hc_sinkhorn_iters``; >= 1).
        hc_eps: added to ``pre`` and to ``comb`` (config ``hc_eps``).
        norm_eps: epsilon of the unweighted RMS norm of the flattened streams
            (config ``rms_norm_eps``, as ``DeepseekV4UnweightedRMSNorm``).
        sites: ``(sublayer norm name, HC module name)`` for every sublayer, in forward
            order: a sublayer is identified by its norm's HF name (unique per sublayer).
        head_name: the head's module name.

    Raises:
        SpecError: ``hc_mult`` / ``hidden_size`` / ``sinkhorn_iters`` < 1, a negative
            epsilon, no site, or a norm or HC name given twice.
    """

    hc_mult: int
    hidden_size: int
    sinkhorn_iters: int
    hc_eps: float
    norm_eps: float
    sites: tuple[tuple[str, str], ...]
    head_name: str = "model.hc_head"

    def __post_init__(self) -> None:
        for field_name in ("hc_mult", "hidden_size", "sinkhorn_iters"):
            if getattr(self, field_name) < 1:
                raise SpecError(f"HyperConnectionSpec.{field_name} must be >= 1, got {getattr(self, field_name)}")
        if self.hc_eps < 0 or self.norm_eps < 0:
            raise SpecError(f"HyperConnectionSpec: negative epsilon (hc_eps {self.hc_eps}, norm_eps {self.norm_eps})")
        if not self.sites:
            raise SpecError("HyperConnectionSpec has no site (one (norm name, HC name) pair per sublayer)")
        for i, which in ((0, "sublayer norm"), (1, "HC module")):
            names = [s[i] for s in self.sites]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise SpecError(f"HyperConnectionSpec: {which} name(s) given twice: {', '.join(dup)}")

    @property
    def num_mixes(self) -> int:
        """``M = (2 + n) n``: the pre (n), post (n) and comb (n x n) logits of one HC pre."""
        return (2 + self.hc_mult) * self.hc_mult

    def site(self, sub: Any) -> str:
        """The HC module name of sublayer ``sub`` (a :class:`~.model.SublayerSpec`).

        Raises:
            SpecError: the sublayer's norm is in no site (names it).
        """
        for norm_name, hc_name in self.sites:
            if norm_name == sub.norm.name:
                return hc_name
        raise SpecError(f"HyperConnectionSpec has no site for the sublayer of layer {sub.index} "
                        f"normed by {sub.norm.name!r}")

    def validate_sublayers(self, sublayers: tuple[Any, ...]) -> None:
        """Check that the sites are exactly the model's sublayers, in forward order.

        Raises:
            SpecError: a sublayer without site, a site without sublayer, or another order.
        """
        want = tuple(sub.norm.name for sub in sublayers)
        have = tuple(n for n, _ in self.sites)
        if want != have:
            missing = sorted(set(want) - set(have))
            extra = sorted(set(have) - set(want))
            raise SpecError(f"HyperConnectionSpec sites do not match the sublayers: missing {missing}, "
                            f"extra {extra}" + ("" if missing or extra else " (order differs)"))

    def trainable_parameter_dtypes(self) -> dict[str, torch.dtype]:
        """Every HC parameter is stored and trained in fp32 (transformers keeps them fp32;
        the published checkpoints store them fp32)."""
        return {n: torch.float32 for n in self.parameter_shapes()}

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every HC parameter: each site's ``fn/base/scale``, then the head's."""
        n, nd, m = self.hc_mult, self.hc_mult * self.hidden_size, self.num_mixes
        out: dict[str, tuple[int, ...]] = {}
        for _, p in self.sites:
            out.update({f"{p}_fn": (m, nd), f"{p}_base": (m,), f"{p}_scale": (3,)})
        h = self.head_name
        out.update({f"{h}.hc_fn": (n, nd), f"{h}.hc_base": (n,), f"{h}.hc_scale": (1,)})
        return out
