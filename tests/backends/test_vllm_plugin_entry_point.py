"""A checkpoint whose config names our architecture loads with a plain
``vllm.LLM(model=DIR)``: vLLM finds our class through the ``vllm.general_plugins``
entry point, in a fresh interpreter that never imported unified_models."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

SCRIPT = textwrap.dedent("""
    import os, sys
    from vllm import LLM, SamplingParams
    llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=256, block_size=64,
              max_num_seqs=2, seed=0, logprobs_mode="raw_logits")
    runner = llm.llm_engine.model_executor.driver_worker.get_model()
    out = llm.generate([{"prompt_token_ids": [1, 2, 3, 4, 5]}],
                       SamplingParams(max_tokens=4, temperature=1.0, seed=1, logprobs=0, detokenize=False),
                       use_tqdm=False)
    print("MODEL_CLASS", type(runner).__module__ + "." + type(runner).__name__)
    print("TOKENS", len(out[0].outputs[0].token_ids))
    print("UNIFIED_IMPORTED_BY_VLLM", "unified_models" in sys.modules)
""")


@pytest.mark.skipif(not any(ep.value.startswith("unified_models") for ep in entry_points(group="vllm.general_plugins")),
                    reason="unified_models is not pip-installed (no entry point metadata)")
def test_plain_vllm_llm_loads_our_architecture(tiny_checkpoint, tmp_path):
    d = tmp_path / "ours"
    shutil.copytree(tiny_checkpoint, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["UnifiedNemotronHForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_USE_V2_MODEL_RUNNER="0", VLLM_LOGGING_LEVEL="ERROR")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(d)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "MODEL_CLASS unified_models.backends.vllm.model.UnifiedForCausalLM" in r.stdout
    assert "TOKENS 4" in r.stdout
    assert "UNIFIED_IMPORTED_BY_VLLM True" in r.stdout
