"""Nemotron-H with every layer type (M Mamba-2, * attention, - MLP, E MoE) on the trainer and reference side.

Checkpoint: the ``nemotron_h_hybrid_tiny`` preset (pattern ``M*-EM-E``, chunk
size 16), written by transformers' own ``NemotronHForCausalLM``. Prompts of
20-70 tokens cross several Mamba chunks.

Tolerances (measured values in brackets, CPU, torch 2.13, transformers 5.19):

* (a) peer, our fp32 reference vs transformers' fp32 ``NemotronHForCausalLM``
  (its torch path: the ``causal_conv1d_fn`` / ``mamba_chunk_scan_combined``
  fallbacks), max |logit diff|: 1e-4 end to end [2.7e-6, max |logit| 2.8] and
  1e-4 x max(1, |output|) per mixer, each fed transformers' own mixer input.
  **Quirk followed for this comparison:** transformers 5.19's
  ``NemotronHMamba2Mixer`` clamps dt with ``(time_step_min, inf)`` on both its
  paths, ignoring ``config.time_step_limit``; our spec follows the config
  (``(0, inf)``, as vLLM's ``MambaMixer2`` and mamba_ssm), so the peer runs our
  reference with the mixer's clamp swapped in. With the config's limit the
  difference is larger [2.5e-5 here; 2.5e-4 on a hotter checkpoint], bounded
  by 1e-3. Transformers also adds ``dt + dt_bias`` in the model dtype and
  rounds the routed-expert sum to the model dtype before adding the shared
  expert; in fp32 both are below the tolerance.
* (b) bf16 trainer forward vs fp64 reference, full-vocabulary logprob rows over
  402 tokens, in bf16 ulps at the row's logit scale (``tests/numerics_helpers.py``):
  < 25 on the rows no flipped expert reaches [8.5]; fewer than 5% of tokens with
  a flipped expert [9 of 402, reaching 32 rows through the Mamba layer 4, max
  302 ulps]. (The bound's derivation, and the mutations it catches on peaked
  models: ``tests/test_peaked_models.py``.) The fp32 spec's forward agrees to
  1e-4 [1.1e-6] (in (d)).
* (c) packing / chunked prefill / decode through the store: bitwise.
* (d) gradients, fp32 spec, ``||g - g_ref|| / ||g_ref||`` worst parameter:
  1e-4 [1.3e-6, a Mamba ``A_log``]; the reference is fp64 autograd through
  the ops' fp64 oracles; the correction bias gets no gradient on either side.
* (e) NVFP4 experts, the MoE layer alone vs the fp64 oracle on the
  dequantized weights: 2e-2 of the output's max [bf16 rounding of the
  output]; an engine-held ModelOpt ``NVFP4Weight`` stack gives the masters'
  bits; end to end as (b) [7.7 bf16 ulps on the 44 of 45 rows no flip
  reaches; 1 token flips, in the last MoE layer].
"""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest
import torch

from numerics_helpers import (BF16_LOGPROB_ULPS, downstream_of_flips, flipped_tokens, logprob_error_ulps,
                              record_routing)
from unified_models import ops
from unified_models.backends.reference import ReferenceModel
from unified_models.converters.modelopt import quantize_state_dict
from unified_models.dsl import Mamba2Spec, MoESpec, SpecError
from unified_models.dsl.weights import LinearFormat
from unified_models.forward import forward_hidden, forward_logprobs
from unified_models.layers import LayerContext
from unified_models.layers.moe import moe_forward
from unified_models.state import FlatBatch, SlotState
from unified_models.private_state import PrivateStateStore

PRESET = "nemotron_h_hybrid_tiny"
VOCAB = 32000


@pytest.fixture(scope="module")
def hybrid_checkpoint(tmp_path_factory):
    from unified_models.presets import build_preset_checkpoint

    return build_preset_checkpoint(PRESET, out_dir=tmp_path_factory.mktemp("hyb") / PRESET)


@pytest.fixture(scope="module")
def hybrid_bf16(hybrid_checkpoint):
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    return spec_and_state_dict(hybrid_checkpoint)


def _seqs(lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lens]


def _cu(lens):
    return torch.tensor([0, *lens]).cumsum(0)


def _hidden(spec, sd, seqs, store=None, starts=None):
    """Trainer forward of sequences (or chunks of them) packed in one batch."""
    ids = torch.cat(seqs)
    cu = _cu([len(s) for s in seqs])
    batch = FlatBatch.from_cu_seqlens(ids, cu, None if starts is None else torch.tensor(starts))
    if store is None:
        store = PrivateStateStore(spec, [len(s) for s in seqs], block_size=16)
    store.bind(batch)
    h = forward_hidden(spec, sd, batch, store)
    return [h[int(cu[i]):int(cu[i + 1])] for i in range(len(seqs))]


def bits(t):
    t = t.detach().contiguous()
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def _with_mamba(spec, **changes):
    return spec.map_mixers(lambda m: dataclasses.replace(m, **changes) if isinstance(m, Mamba2Spec) else m)


def _nvfp4_experts(spec, *, stored: bool = False):
    """``spec`` with every routed expert in NVFP4 (master form by default)."""
    return spec.with_weight_formats({
        m.expert_linear(e, p): LinearFormat("nvfp4", stored=stored)
        for m in (s.mixer for s in spec.sublayers_of(MoESpec)) for e in range(m.n_routed_experts)
        for p in ("up_proj", "down_proj")})


# ----------------------------------------------------------------------------- spec


def test_spec_has_every_layer_type_and_checkpoint_names(hybrid_checkpoint, hybrid_bf16):
    from safetensors import safe_open

    cfg, spec, _ = hybrid_bf16
    assert spec.extra["pattern"] == "M*-EM-E"
    kinds = [type(b.mixer).__name__ for b in spec.sublayers]
    assert kinds == ["Mamba2Spec", "AttentionSpec", "MLPSpec", "MoESpec", "Mamba2Spec", "MLPSpec", "MoESpec"]
    m, e = spec.sublayers[0].mixer, spec.sublayers[3].mixer
    assert (m.chunk_size, m.conv_kernel, m.time_step_limit) == (16, 4, (0.0, math.inf))
    assert (e.n_routed_experts, e.top_k, e.routed_scaling_factor, spec.weight_formats) == (8, 2, 2.5, ())
    with safe_open(str(hybrid_checkpoint / "model.safetensors"), "pt") as f:
        theirs = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    assert spec.parameter_shapes() == theirs


def test_refusals_name_the_problem():
    from transformers import NemotronHConfig

    from unified_models.models import spec_from_hf_config

    base = dict(hybrid_override_pattern="ME", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, intermediate_size=128, vocab_size=100, mamba_num_heads=4, mamba_head_dim=16,
                n_groups=2, ssm_state_size=16, n_routed_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32, moe_shared_expert_intermediate_size=32)
    with pytest.raises(SpecError, match="latent MoE"):
        spec_from_hf_config(NemotronHConfig(**{**base, "moe_latent_size": 32}))
    with pytest.raises(SpecError, match="n_shared_experts=2"):
        spec_from_hf_config(NemotronHConfig(**{**base, "n_shared_experts": 2}))
    with pytest.raises(SpecError, match="not a multiple of n_groups"):
        spec_from_hf_config(NemotronHConfig(**{**base, "n_groups": 3}))
    cfg = NemotronHConfig(**base)
    # ModelOpt NVFP4: routed experts quantized, everything else excluded -> nvfp4 experts
    hf_quant = {"producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "NVFP4", "group_size": 16,
        "exclude_modules": ["lm_head", "*.mixer.in_proj", "*.mixer.out_proj", "*shared_experts*"]}}
    spec = spec_from_hf_config(cfg, quant_config=hf_quant)
    expert = "backbone.layers.1.mixer.experts.0.up_proj"
    assert spec.weight_format(expert) == LinearFormat("nvfp4", stored=True, input_scale=True)
    assert spec.weight_format("backbone.layers.0.mixer.in_proj") is None
    mixed = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": {
        **{f"backbone.layers.1.mixer.experts.{e}.{p}": {"quant_algo": "NVFP4"} for e in range(4)
           for p in ("up_proj", "down_proj")}}}
    assert spec_from_hf_config(cfg, quant_config=mixed).weight_format(expert).format == "nvfp4"
    fp8_mamba = {**mixed, "quantized_layers": {**mixed["quantized_layers"],
                                               "backbone.layers.0.mixer.in_proj": {"quant_algo": "FP8"}}}
    with pytest.raises(SpecError, match="layers.0.mixer: Mamba projections in formats .*in_proj.*fp8.*both 'fp8' or neither"):
        spec_from_hf_config(cfg, quant_config=fp8_mamba)
    both = {**mixed, "quantized_layers": {**mixed["quantized_layers"], **{
        f"backbone.layers.0.mixer.{p}": {"quant_algo": "FP8"} for p in ("in_proj", "out_proj")}}}
    fp8_spec = spec_from_hf_config(cfg, quant_config=both)
    assert fp8_spec.weight_format("backbone.layers.0.mixer.in_proj") == LinearFormat("fp8", stored=True, input_scale=True)
    assert fp8_spec.weight_format(expert).input_scale  # "NVFP4" = W4A4 export
    assert fp8_spec.stores_quantized_weights and not spec_from_hf_config(cfg).stores_quantized_weights
    assert fp8_spec.parameter_dtypes()["backbone.layers.0.mixer.in_proj.weight"] == torch.float8_e4m3fn
    assert fp8_spec.parameter_shapes()["backbone.layers.1.mixer.experts.0.up_proj.weight_scale"] == (
        fp8_spec.sublayers[1].mixer.intermediate_size, fp8_spec.sublayers[1].mixer.hidden_size // 16)
    with pytest.raises(SpecError, match="shared_experts.up_proj: a weight format on the router or the shared expert is not supported"):
        spec_from_hf_config(cfg, quant_config={**mixed, "quantized_layers": {
            **mixed["quantized_layers"], "backbone.layers.1.mixer.shared_experts.up_proj": {"quant_algo": "FP8"}}})
    with pytest.raises(SpecError, match="layers.0.mixer: Mamba projections in formats .*'in_proj': 'nvfp4'"):
        spec_from_hf_config(cfg, quant_config={"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": []})
    with pytest.raises(SpecError, match="every expert of a layer must have the same format"):
        half = {**mixed, "quantized_layers": {"backbone.layers.1.mixer.experts.0.up_proj": {"quant_algo": "NVFP4"}}}
        spec_from_hf_config(cfg, quant_config=half)


# ----------------------------------------------------------------------------- (a) peer


@pytest.fixture(scope="module")
def peer(hybrid_checkpoint):
    from transformers import AutoModelForCausalLM

    from unified_models.converters.hf_safetensors import spec_and_state_dict

    cfg, spec, sd = spec_and_state_dict(hybrid_checkpoint, dtype=torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(str(hybrid_checkpoint), dtype=torch.float32).eval()
    return cfg, spec, sd, hf


def test_peer_reference_matches_transformers_module_by_module_and_end_to_end(peer):
    cfg, spec, sd, hf = peer
    ids = _seqs([57])[0]
    captured = {}
    hooks = [layer.mixer.register_forward_hook(
        lambda mod, args, kwargs, out, i=i: captured.__setitem__(
            i, ((args[0] if args else kwargs["hidden_states"]).detach(), (out[0] if isinstance(out, tuple) else out)
                .detach())), with_kwargs=True)
        for i, layer in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            theirs = hf(ids[None]).logits[0]
    finally:
        for h in hooks:
            h.remove()
    hf_clamp = _with_mamba(spec, time_step_limit=(float(cfg.time_step_min), math.inf))
    ref = ReferenceModel(hf_clamp, dtype=torch.float32)
    ref.load_state_dict_hf(sd)
    with torch.no_grad():
        for blk in hf_clamp.sublayers:
            if blk.index not in captured:
                continue
            x, y = captured[blk.index]
            ours = ref.mixer_output(blk.mixer, x[0])
            err = (ours - y[0]).abs().max().item()
            assert err < 1e-4 * max(1.0, y.abs().max().item()), f"layer {blk.index} {type(blk.mixer).__name__}: {err}"
    assert {b.index for b in spec.sublayers} <= set(captured)
    err = (ref.logits(ids) - theirs).abs().max().item()
    print(f"PEER max |logit diff| (transformers' dt clamp): {err:.3e}; max |logit| {theirs.abs().max():.2f}")
    assert err < 1e-4
    own = ReferenceModel(spec, dtype=torch.float32)
    own.load_state_dict_hf(sd)
    err_cfg = (own.logits(ids) - theirs).abs().max().item()
    print(f"PEER max |logit diff| (config time_step_limit): {err_cfg:.3e}")
    assert err_cfg < 1e-3


# ----------------------------------------------------------------------------- (b) bf16 vs reference


@pytest.fixture(scope="module")
def ref64(hybrid_bf16):
    _, spec, sd = hybrid_bf16
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    return ref


def test_bf16_trainer_forward_matches_fp64_reference(hybrid_bf16, ref64, monkeypatch):
    """Full-vocabulary logprob rows within the bf16 bound (bf16 ulps at the row's logit
    scale, ``tests/numerics_helpers.py``), except the rows a flipped expert choice reaches:
    a near-tie of two experts' scores flips with bf16 activations (a discrete, legal
    difference) and the Mamba layer after the first MoE carries it to later tokens; the
    tokens with a flipped expert are counted."""
    _, spec, sd = hybrid_bf16
    errs, flips, reach = [], [], []
    for seed in range(3):
        for n in (41, 70, 23):
            s = _seqs([n], seed=seed)[0]
            ours, theirs = record_routing(monkeypatch, spec)
            h = _hidden(spec, sd, [s])[0]
            want = ref64.logits(s)
            monkeypatch.undo()
            errs.append(logprob_error_ulps(forward_logprobs(spec, sd, h), want))
            flips.append(flipped_tokens(ours, theirs, n))
            reach.append(downstream_of_flips(spec, ours, theirs, n))
    k, f, r = torch.cat(errs), torch.cat(flips), torch.cat(reach)
    print(f"BF16 vs fp64 reference over {k.numel()} rows: max {k[~r].max():.2f} median {k.median():.2f} bf16 ulps "
          f"where no flipped expert reaches (bound {BF16_LOGPROB_ULPS}); {int(f.sum())} tokens with a flipped "
          f"expert, reaching {int(r.sum())} rows (max {k.max():.1f})")
    assert len(ours) == 2
    assert k[~r].max() < BF16_LOGPROB_ULPS
    assert f.float().mean() < 0.05


# ----------------------------------------------------------------------------- (c) bitwise invariance


def test_trainer_forward_is_bitwise_invariant_to_packing(hybrid_bf16):
    _, spec, sd = hybrid_bf16
    seqs = _seqs([37, 1, 70, 16, 5], seed=2)
    packed = _hidden(spec, sd, seqs)
    reordered = _hidden(spec, sd, seqs[::-1])[::-1]
    for i, s in enumerate(seqs):
        alone = _hidden(spec, sd, [s])[0]
        assert torch.equal(bits(packed[i]), bits(alone)), f"sequence {i}: packed != alone"
        assert torch.equal(bits(packed[i]), bits(reordered[i])), f"sequence {i}: order changes bits"


def test_chunked_prefill_and_decode_through_the_store_are_bitwise(hybrid_bf16):
    """Sequences split into a prefix, continuation chunks (crossing chunk boundaries
    at arbitrary offsets, shorter than the conv width too) and token-by-token
    decode, in mixed batches, give the full forward's bits at every position."""
    _, spec, sd = hybrid_bf16
    lens = [53, 40, 35]
    seqs = _seqs(lens, seed=3)
    full = _hidden(spec, sd, seqs)
    # per sequence, the chunk lengths of each step (0 = not in this step)
    plan = [[13, 2, 1, 20, 1, 1, 1, 14],
            [16, 0, 17, 1, 1, 5, 0, 0],
            [1, 1, 1, 30, 0, 1, 0, 1]]
    assert [sum(p) for p in plan] == lens
    store = PrivateStateStore(spec, lens, block_size=16)
    pos = [0, 0, 0]
    got = [[] for _ in lens]
    for step in range(len(plan[0])):
        chunks = [seqs[b][pos[b]:pos[b] + plan[b][step]] for b in range(len(lens))]
        out = _hidden(spec, sd, chunks, store=store, starts=list(pos))
        for b in range(len(lens)):
            got[b].append(out[b])
            pos[b] += plan[b][step]
    for b in range(len(lens)):
        assert torch.equal(bits(torch.cat(got[b])), bits(full[b])), f"sequence {b}: chunked != full"
    # a prefix of 5, then pure token-by-token decode across three chunk boundaries
    s = seqs[1]
    store = PrivateStateStore(spec, [len(s)], block_size=16)
    steps = [_hidden(spec, sd, [s[:5]], store=store, starts=[0])[0]]
    steps += [_hidden(spec, sd, [s[p:p + 1]], store=store, starts=[p])[0] for p in range(5, len(s))]
    assert torch.equal(bits(torch.cat(steps)), bits(full[1]))


def test_profiling_run_without_state_runs(hybrid_bf16):
    _, spec, sd = hybrid_bf16

    class NoState:
        def state(self, i, name):
            return None

    ids = _seqs([20])[0]
    batch = FlatBatch(input_ids=ids, positions=torch.arange(20), seq_idx=torch.zeros(20, dtype=torch.int32))
    h = forward_hidden(spec, sd, batch, NoState())
    assert h.shape == (20, spec.hidden_size) and bool(torch.isfinite(h.float()).all())


def test_mamba_metadata_is_built_once_per_forward(hybrid_bf16, monkeypatch):
    _, spec, sd = hybrid_bf16
    calls = []
    real = ops.mamba2_metadata
    monkeypatch.setattr(ops, "mamba2_metadata", lambda *a, **k: calls.append(1) or real(*a, **k))
    _hidden(spec, sd, _seqs([30, 18]))
    assert len(spec.sublayers_of(Mamba2Spec)) == 2 and len(calls) == 1


def test_store_contract(hybrid_bf16):
    _, spec, _ = hybrid_bf16
    store = PrivateStateStore(spec, [5, 7])
    batch = FlatBatch.from_cu_seqlens(torch.zeros(4, dtype=torch.long), torch.tensor([0, 3, 4]),
                                      start_positions=torch.tensor([2, 6]))
    store.bind(batch)
    ms = store.state(0, "state_cache")
    assert isinstance(ms, SlotState) and isinstance(ms.state, ops.Mamba2State)
    assert ms.slots_B.dtype == torch.int32 and ms.slots_B.tolist() == [0, 1]
    assert ms.start_B.dtype == torch.int64 and ms.start_B.tolist() == [2, 6]
    assert ms.cu_seqlens_B1.tolist() == [0, 3, 4]
    assert ms.state.ssm.shape == (2, 8, 16, 16) and ms.state.ssm.dtype == torch.float32
    assert ms.state.conv.shape == (2, 3, spec.sublayers[0].mixer.conv_dim) and ms.state.conv.dtype == torch.bfloat16
    assert store.state(4, "state_cache").state is not ms.state  # each layer its own slots


# ----------------------------------------------------------------------------- (d) gradients


def test_gradients_match_fp64_reference(hybrid_checkpoint):
    from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    init_parallel_state()
    _, spec, sd = spec_and_state_dict(hybrid_checkpoint, dtype=torch.float32)
    model = UnifiedMegatronModel(spec, device="cpu")
    model.load_hf_state_dict(sd)
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    seqs = _seqs([21, 34], seed=4)
    temperature = 0.9
    model.requires_grad_(True)
    model.zero_grad(set_to_none=True)
    tok = model.token_logprobs(torch.cat(seqs), _cu([21, 34]), temperature=temperature)
    tok.sum().backward()
    logits = inspect.unwrap(ReferenceModel.logits)
    ref.params.requires_grad_(True)
    total, want_tok = 0, []
    for s in seqs:
        lp = torch.log_softmax(logits(ref, s) / temperature, dim=-1)
        want_tok.append(lp[:-1].gather(1, s[1:, None])[:, 0])
        total = total + want_tok[-1].sum()
    total.backward()
    fwd_err = (tok.double() - torch.cat(want_tok)).abs().max().item()
    print(f"FP32 forward vs fp64 reference: max |dlogprob| {fwd_err:.3e}")
    assert fwd_err < 1e-4
    errs = {}
    for name, p in model.named_parameters():
        want = ref.p(name).grad
        if name.endswith("e_score_correction_bias"):  # only selects experts: no gradient on either side
            assert p.grad is None or p.grad.abs().max() == 0, name
            assert want is None or want.abs().max() == 0, name
            continue
        assert p.grad is not None and want is not None, name
        errs[name] = float((p.grad.double() - want).norm() / want.norm())
    worst = max(errs, key=errs.get)
    print(f"GRAD-ERR hybrid fp32: worst {errs[worst]:.3e} ({worst})")
    assert errs[worst] < 1e-4, f"{worst}: {errs[worst]:.3e}"
    for kind in ("A_log", "dt_bias", "conv1d.weight", "experts.0.up_proj", "gate.weight", "shared_experts"):
        assert any(kind in n for n in errs), f"no gradient checked for {kind}"


# ----------------------------------------------------------------------------- (e) NVFP4 experts


def test_nvfp4_experts_match_reference_on_dequantized_weights(hybrid_bf16, monkeypatch):
    _, spec, sd = hybrid_bf16
    nv = _nvfp4_experts(spec)
    blk = nv.sublayers[3]
    m = blk.mixer
    x = (torch.randn(40, spec.hidden_size, generator=torch.Generator().manual_seed(5)) * 0.5).to(spec.dtype)
    y = moe_forward(m, blk.index, sd, x, None, None, LayerContext(model=nv))
    ref = ReferenceModel(nv, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    want = ref.mixer_output(m, x.double())
    rel = ((y.double() - want).abs().max() / want.abs().max()).item()
    assert rel < 2e-2, rel
    # the quantization is real: the bf16 layer gives other values
    plain = moe_forward(spec.sublayers[3].mixer, blk.index, sd, x, None, None, LayerContext(model=spec))
    assert not torch.equal(plain, y)
    # the stored NVFP4 codes an engine holds (ModelOpt format) give the same bits as the masters
    stored = _nvfp4_experts(spec, stored=True)
    engine = quantize_state_dict(sd, stored)
    assert engine[m.expert_linear(0, "up_proj") + ".weight"].dtype == torch.uint8
    assert torch.equal(bits(moe_forward(m, blk.index, engine, x, None, None, LayerContext(model=stored))), bits(y))
    # end to end: bf16 forward with NVFP4 experts vs the fp64 reference on the dequantized weights,
    # the bf16 bound of (b) on the rows no flipped expert reaches
    s = _seqs([45], seed=6)[0]
    ours, theirs = record_routing(monkeypatch, nv)
    h = _hidden(nv, sd, [s])[0]
    want = ref.logits(s)
    monkeypatch.undo()
    reach = downstream_of_flips(nv, ours, theirs, 45)
    k = logprob_error_ulps(forward_logprobs(nv, sd, h), want)
    print(f"NVFP4 bf16 vs fp64 reference: max {k[~reach].max():.2f} bf16 ulps where no flipped expert reaches, "
          f"{int(flipped_tokens(ours, theirs, 45).sum())} flipped, reaching {int(reach.sum())} rows")
    assert k[~reach].max() < BF16_LOGPROB_ULPS and (~reach).sum() >= 40
    # and it is packing invariant, bitwise
    other = _seqs([9, 30], seed=7)
    assert torch.equal(bits(_hidden(nv, sd, [other[0], s, other[1]])[1]), bits(h))


def test_stale_expert_weight_guard_names_the_expert(hybrid_checkpoint):
    from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state

    init_parallel_state()
    model = UnifiedMegatronModel.from_pretrained(hybrid_checkpoint, device="cpu")
    model.requires_grad_(True)
    seqs = _seqs([12, 9], seed=8)
    name = "backbone.layers.3.mixer.experts.5.down_proj.weight"
    loss = model.token_logprobs(torch.cat(seqs), _cu([12, 9])).sum()
    with torch.no_grad():
        model.get_parameter(name).mul_(1.0)
    # the module keeps a layer's experts in one buffer (shared version counter): a write to any
    # of them invalidates the layer's expert stack, and the error names an expert weight of it
    with pytest.raises(ops.StaleWeightError,
                       match=r"moe_experts backward: expert \d+ down_proj 'backbone.layers.3.mixer.experts.\d+"):
        loss.backward()


def test_module_values_bitwise_equal_with_and_without_grad(hybrid_checkpoint, hybrid_bf16):
    """The Megatron module (bf16, every layer type) gives the same bits with and without a
    graph, and the same bits as the bare forward with the trainer store."""
    from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state

    init_parallel_state()
    _, spec, sd = hybrid_bf16
    model = UnifiedMegatronModel.from_pretrained(hybrid_checkpoint, device="cpu")
    seqs = _seqs([33, 18], seed=9)
    ids, cu = torch.cat(seqs), _cu([33, 18])
    model.requires_grad_(True)
    with torch.no_grad():
        plain = model(ids, cu)
    graph = model(ids, cu)
    assert graph.grad_fn is not None
    assert torch.equal(bits(graph), bits(plain))
    assert torch.equal(bits(plain), bits(torch.cat(_hidden(spec, sd, seqs))))
