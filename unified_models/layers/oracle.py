"""Plain-PyTorch pieces shared by the families' oracles (the reference model's math).

Everything here computes in the dtype of its inputs (fp32 or fp64), differentiable.
Shapes: T tokens, D hidden, K input features, N output features.
"""

from __future__ import annotations

from typing import Mapping

import torch


def rms_norm_oracle(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019; transformers ``NemotronHRMSNorm``)."""
    return x_TD * torch.rsqrt(x_TD.pow(2).mean(-1, keepdim=True) + eps) * weight_D


def linear_oracle(x_TK: torch.Tensor, params: Mapping[str, torch.Tensor], name: str, bias: bool) -> torch.Tensor:
    """``x @ params[name.weight]^T (+ params[name.bias])``: ``[T, K] -> [T, N]``."""
    y = x_TK @ params[name + ".weight"].t()
    return y + params[name + ".bias"] if bias else y
