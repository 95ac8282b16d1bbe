"""GRPO loop: vLLM rollout -> Megatron recompute and compare -> update -> in-place weight sync.

* :mod:`.rewards`  pluggable rewards (``gsm8k``, ``target-token``; :func:`register_reward`)
* :mod:`.grpo`     group-normalised advantages, the GRPO loss, importance ratio, k3 KL
* :mod:`.data`     prompt rows and the deterministic per-step prompt / seed schedule
* :mod:`.metrics`  one JSON line per step
* :mod:`.plot`     reward and diff per step as a PNG
* :mod:`.loop`     the run behind ``unified-models rl`` (imports the engines lazily)
"""

from .grpo import group_advantages, grpo_loss, importance_ratio, k3_kl, token_weights
from .rewards import build_reward, register_reward, reward_info, reward_names

__all__ = ["group_advantages", "grpo_loss", "importance_ratio", "k3_kl", "token_weights", "build_reward",
           "register_reward", "reward_info", "reward_names"]
