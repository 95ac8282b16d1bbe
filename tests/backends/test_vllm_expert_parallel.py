"""Rollout data parallelism and expert parallelism inside vLLM with our model class (issue 19 item 3).

The slow test runs ``tests/backends/vllm_ep_worker.py`` three times: once in one process (DP = 1,
every prompt: the reference) and twice under ``torchrun --standalone --nproc-per-node 2`` (vLLM
DP = 2 through its ``external_launcher``; EP = 1 and EP = 2 over vLLM's EP group, gloo), with the
prompts split unevenly (rank 0 three, rank 1 one: rank 1 runs dummy batches while rank 0 decodes).
Tokens and fp32 logprob bits must equal the reference's, before and after an in-place update that
scales every routed expert (rank 0 syncs a full HF state dict, rank 1 only its own tensors).

The other tests check the refusals and the expert bookkeeping without starting an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("vllm_ep_worker.py")
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))


def _run(cmd: list[str], cwd: Path) -> None:
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    root = tmp_path_factory.mktemp("vllm_ep")
    return root, build_preset_checkpoint("nemotron_h_hybrid_tiny", out_dir=root / "hybrid")


@pytest.fixture(scope="module")
def reference(hybrid):
    root, model = hybrid
    _run([sys.executable, str(WORKER), str(model), str(root / "single"), "--single"], root)
    return json.loads((root / "single.0.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2], ids=["dp2_ep1", "dp2_ep2"])
def test_vllm_dp2_rollout_bitwise_equals_single_process(hybrid, reference, ep):
    root, model = hybrid
    out = root / f"ep{ep}"
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(WORKER),
          str(model), str(out), "--ep", str(ep)], root)
    ranks = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in (0, 1)]
    assert [r["prompts"] for r in ranks] == [[0, 1, 2], [3]]
    assert reference["prompts"] == [0, 1, 2, 3] and reference["ep"] == 1
    compared = 0
    for r in ranks:
        assert r["ep"] == ep
        assert r["settings"] == {"data_parallel_size": 2, "expert_parallel_size": ep, "cuda_graphs": False}
        assert r["contract_fingerprint"] == reference["contract_fingerprint"]  # the same contract at every layout
        for tag in ("before", "after"):
            for i, got in r[tag].items():
                want = reference[tag][i]
                assert got["tokens"] == want["tokens"], (ep, tag, i)
                assert got["bits"] == want["bits"], (ep, tag, i)  # fp32 logprob bits: diff = 0
                assert len(got["bits"]) == 8
                compared += len(got["bits"])
        # the update changed what is sampled from (not a vacuous comparison)
        assert any(r["before"][i]["bits"] != r["after"][i]["bits"] for i in r["before"])
    assert compared == 2 * 4 * 8
    total = reference["held_expert_tensors"]  # 2 MoE layers x 8 experts x (up, down) = 32
    assert total == 32 and reference["sync"]["copied"] == 32
    for r in ranks:
        held = total // ep
        assert r["held_expert_tensors"] == held and r["foreign_expert_tensors"] == total - held
        # only the experts held here were copied and fingerprinted
        assert r["sync"]["copied"] == held and r["sync"]["foreign_checked"] == 0
        assert r["sync"]["checked"] == reference["sync"]["checked"] - (total - held)
    assert [r["sync"]["given"] for r in ranks] == ([74, 74] if ep == 1 else [74, 58])  # full, this rank's only
    if ep == 2:  # both ranks made the same MoE calls (dummy batches included) and tokens crossed
        calls = [r["dispatcher"]["calls"] for r in ranks]
        assert calls[0] == calls[1] > 0
        assert all(r["dispatcher"]["rows_sent_remote"] > 0 for r in ranks)
    else:
        assert all(r["dispatcher"] is None for r in ranks)


# ---------------------------------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def hybrid_spec():
    from unified_models.presets import build_preset_checkpoint
    from unified_models.converters.hf_safetensors import load_hf_config
    from unified_models.models import spec_from_hf_config

    model = build_preset_checkpoint("nemotron_h_hybrid_tiny")
    return model, spec_from_hf_config(load_hf_config(model))


def _torchrun(world: int) -> dict:
    return {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29500"}


def test_data_parallel_settings_refusals(hybrid_spec):
    from unified_models.backends.vllm.settings import data_parallel_settings
    from unified_models.dsl import ParallelismError

    _, spec = hybrid_spec
    assert data_parallel_settings(spec) == {}
    assert data_parallel_settings(spec, data_parallel_size=2, enable_expert_parallel=True, environ=_torchrun(2)) == {
        "data_parallel_size": 2, "enable_expert_parallel": True, "distributed_executor_backend": "external_launcher"}
    assert data_parallel_settings(spec, data_parallel_size=2, environ=_torchrun(2))["enable_expert_parallel"] is False
    with pytest.raises(ParallelismError, match=r"torchrun --nproc-per-node 2 .*WORLD_SIZE=<unset>"):
        data_parallel_settings(spec, data_parallel_size=2, environ={})
    with pytest.raises(ParallelismError, match="WORLD_SIZE=4"):
        data_parallel_settings(spec, data_parallel_size=2, environ=_torchrun(4))
    with pytest.raises(ParallelismError, match="enable_expert_parallel=True with data_parallel_size=1"):
        data_parallel_settings(spec, enable_expert_parallel=True)
    with pytest.raises(ParallelismError, match="expert_model_parallel_size=3 does not divide the 8 routed experts"):
        data_parallel_settings(spec, data_parallel_size=3, enable_expert_parallel=True, environ=_torchrun(3))
    with pytest.raises(ParallelismError, match="positive integer"):
        data_parallel_settings(spec, data_parallel_size=0)


def test_make_llm_refuses_before_vllm_starts(hybrid_spec, monkeypatch):
    from unified_models.backends.vllm.engine import make_llm
    from unified_models.dsl import ParallelismError

    model, spec = hybrid_spec
    for k in TORCHRUN_ENV:
        monkeypatch.delenv(k, raising=False)
    with pytest.raises(ParallelismError, match="data_parallel_size=2 runs one DP rank per process under torchrun"):
        make_llm(model, spec=spec, data_parallel_size=2)
    with pytest.raises(ParallelismError, match="enable_expert_parallel=True with data_parallel_size=1"):
        make_llm(model, spec=spec, enable_expert_parallel=True)
    for k, v in _torchrun(2).items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValueError, match="distributed_executor_backend='mp'"):
        make_llm(model, spec=spec, data_parallel_size=2, distributed_executor_backend="mp")
    with pytest.raises(ValueError, match="pins.*tensor_parallel_size"):
        make_llm(model, spec=spec, data_parallel_size=2, tensor_parallel_size=2)


def test_cuda_graphs_off_at_rollout_ep(hybrid_spec):
    from unified_models.backends.vllm.settings import cuda_graph_settings
    from unified_models.dsl import SpecError

    _, spec = hybrid_spec
    assert cuda_graph_settings(spec, gpu=True, cuda_graphs=None, expert_parallel_size=2) == {"enforce_eager": True}
    assert cuda_graph_settings(spec, gpu=True, cuda_graphs=None)["enforce_eager"] is False
    with pytest.raises(SpecError, match=r"EP = 2\) exchanges tokens with all_to_all_single"):
        cuda_graph_settings(spec, gpu=True, cuda_graphs=True, expert_parallel_size=2)


def test_expert_shards_and_weight_table(hybrid_spec):
    """This rank's experts (contiguous block, global names, one stack), and the weight-table rule:
    other ranks' experts optional but shape-checked, unknown names refused."""
    from unified_models.backends.vllm.weight_loading import WeightLoading
    from unified_models.layers.expert_parallel import ShardPlan
    from unified_models.layers.expert_shards import expert_tensor_groups, foreign_expert_shapes, with_absent_experts
    from unified_models.parameters import allocate_parameters

    _, spec = hybrid_spec
    groups = expert_tensor_groups(spec)
    assert len(groups) == 4 and all(len(g) == 8 for g in groups)  # 2 MoE layers x (up, down), 8 experts
    plan = ShardPlan(ep_size=2, ep_rank=1)
    foreign = foreign_expert_shapes(spec, plan)
    assert set(foreign) == {n for g in groups for n in g[:4]}
    params = allocate_parameters(spec, "cpu", plan)
    full = spec.parameter_shapes()
    assert set(params) == set(full) - set(foreign)
    for g in groups:
        held = [params[n] for n in g[4:]]
        assert all(t.untyped_storage().data_ptr() == held[0].untyped_storage().data_ptr() for t in held)
        assert held[0].untyped_storage().nbytes() == 4 * held[0].numel() * held[0].element_size()
    assert set(with_absent_experts(spec, params)) == set(full)
    assert foreign_expert_shapes(spec, ShardPlan()) == {}

    m = WeightLoading()
    m._shapes = {n: s for n, s in full.items() if n not in foreign}
    m._foreign_experts = foreign
    got = dict(full)
    assert m.weight_table_problems(m.held_shapes(), got, require_all=True) == []  # full HF state dict
    mine = {n: s for n, s in full.items() if n not in foreign}
    assert m.weight_table_problems(m.held_shapes(), mine, require_all=True) == []  # this rank's only
    some_foreign = groups[0][0]
    bad = dict(got, **{some_foreign: (1, 2), "backbone.layers.99.mixer.experts.0.up_proj.weight": (1,)})
    problems = " ".join(m.weight_table_problems(m.held_shapes(), bad, require_all=True))
    assert "unexpected tensors: ['backbone.layers.99.mixer.experts.0.up_proj.weight']" in problems
    assert f"{some_foreign}: expected {foreign[some_foreign]}, got (1, 2)" in problems
    missing = {n: s for n, s in mine.items() if n != groups[0][7]}
    assert f"missing tensors: ['{groups[0][7]}']" in " ".join(
        m.weight_table_problems(m.held_shapes(), missing, require_all=True))
    assert torch.Size(foreign[some_foreign]) == torch.Size(full[some_foreign])
