"""GRPO loop: vLLM rollout -> Megatron recompute and compare -> update -> in-place weight sync.

* :mod:`.rewards`  pluggable rewards (``gsm8k``, ``target-token``; :func:`register_reward`)
* :mod:`.grpo`     group-normalised advantages, the GRPO loss, importance ratio, k3 KL
* :mod:`.data`     prompt rows and the deterministic per-step prompt / seed schedule
* :mod:`.metrics`  one JSON line per step
* :mod:`.plot`     reward and diff per step as a PNG
* :mod:`.options`  the ``rl`` options, their defaults and refusals
* :mod:`.startup`  checkpoint and prompts read once, the engines started, resume and save
* :mod:`.run`      one GRPO step over the two engines (:class:`~.run.RLRun`)
* :mod:`.report`   the per-step line and the summary table
* :mod:`.loop`     the run behind ``unified-models rl`` (imports the engines lazily)
"""

from .grpo import group_advantages, grpo_loss, importance_ratio, k3_kl, token_weights
from .rewards import build_reward, register_reward, reward_info, reward_names

__all__ = ["group_advantages", "grpo_loss", "importance_ratio", "k3_kl", "token_weights", "build_reward",
           "register_reward", "reward_info", "reward_names"]
