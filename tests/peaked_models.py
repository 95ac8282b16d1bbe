"""Small test checkpoints whose next-token distribution is peaked (issue 16, item 8).

The built-in presets are random models that are nearly uniform over 32k tokens:
any bound on logprobs is easy to meet there. These checkpoints are written by
transformers' own ``NemotronHForCausalLM`` exactly as
:func:`unified_models.presets.build_preset_checkpoint` writes a preset
(``AutoConfig.for_model`` -> seeded ``from_config`` in fp32 -> bf16 ->
``save_pretrained``), with two changes that make the logits O(10) and the
distribution peaked:

* ``initializer_range`` 0.05 (the default is 0.02), so every sublayer adds an
  O(1) share to the residual stream and the hidden state depends on the context;
* the LM head scaled by :data:`LM_HEAD_SCALE` after init, so the logits of a
  row have a standard deviation of about 4.5 (mean max-probability ~0.4-0.5,
  entropy ~2 nats vs log(1024) = 6.9).

Vocabulary 1024 (no tokenizer: the tests feed token ids), widths as the tiny
hybrid preset. Two models: ``attention`` (pattern ``*-*-``) and ``hybrid``
(``M*-E``: Mamba-2, attention, MLP, MoE; the MoE is the last layer, so a
near-tie of two experts that flips under bf16 changes only its own token).
Building both takes about 2 s. The presets (and their ``rollout_sha256``)
are untouched.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

VOCAB = 1024
LM_HEAD_SCALE = 8.0
INITIALIZER_RANGE = 0.05
SEED = 0

_COMMON = dict(
    hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
    mlp_hidden_act="relu2", initializer_range=INITIALIZER_RANGE, vocab_size=VOCAB, max_position_embeddings=512,
    layer_norm_epsilon=1.0e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
)

PEAKED_CONFIGS: dict[str, dict] = {
    "attention": dict(_COMMON, hybrid_override_pattern="*-*-"),
    "hybrid": dict(
        _COMMON, hybrid_override_pattern="M*-E",
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        use_conv_bias=True, time_step_min=0.001, time_step_max=0.1,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        moe_shared_expert_intermediate_size=128, n_shared_experts=1, routed_scaling_factor=2.5,
        n_group=1, topk_group=1, norm_topk_prob=True,
    ),
}
"""``hf_config`` of each peaked test model (``NemotronHConfig`` keyword arguments)."""

# What the fixture asserts about the saved weights (transformers' fp32 forward on a
# random probe sequence): far from uniform, and not one constant token either.
MIN_MEAN_MAX_PROB = 0.2
MAX_ENTROPY_FRACTION = 0.5  # mean entropy < this * log(V)
MIN_DISTINCT_ARGMAX = 16  # over the 64 probe positions


def distribution_stats(logits_TV: torch.Tensor) -> dict:
    """Mean max-probability, mean entropy (nats), distinct argmax tokens of ``[T, V]`` logits."""
    lp = torch.log_softmax(logits_TV.double(), -1)
    p = lp.exp()
    return {
        "mean_max_prob": float(p.max(-1).values.mean()),
        "mean_entropy": float(-(p * lp).sum(-1).mean()),
        "log_vocab": math.log(logits_TV.shape[-1]),
        "distinct_argmax": int(lp.argmax(-1).unique().numel()),
    }


def build_peaked_checkpoint(name: str, out_dir: str | Path) -> tuple[Path, dict]:
    """Write the peaked test model ``name`` (a key of :data:`PEAKED_CONFIGS`) to ``out_dir``.

    Deterministic (seeded; the global RNG state is restored afterwards).

    Returns:
        ``(directory, distribution_stats)``, the stats measured by transformers'
        fp32 forward on exactly the saved (bf16-rounded) weights.

    Raises:
        AssertionError: the distribution is not peaked enough for the bounds to mean something.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    out_dir = Path(out_dir)
    config = AutoConfig.for_model("nemotron_h", **PEAKED_CONFIGS[name])
    config.architectures = ["NemotronHForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        probe = torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(SEED))
    with torch.no_grad():
        model.lm_head.weight.mul_(LM_HEAD_SCALE)
        for p in model.parameters():  # the values the bf16 checkpoint will hold
            p.copy_(p.to(torch.bfloat16).float())
        stats = distribution_stats(model(probe).logits[0])
    assert stats["mean_max_prob"] > MIN_MEAN_MAX_PROB, (name, stats)
    assert stats["mean_entropy"] < MAX_ENTROPY_FRACTION * stats["log_vocab"], (name, stats)
    assert stats["distinct_argmax"] >= MIN_DISTINCT_ARGMAX, (name, stats)
    model.to(torch.bfloat16).save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir, stats
