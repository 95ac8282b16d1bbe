"""Optimizer plumbing and training checkpoints: resume from step k equals an uninterrupted run, bitwise.

A small bf16 Nemotron-H (attention + MLP) trained through the module's
``token_logprobs`` on batches drawn from the Python, NumPy and torch RNGs every
step, so a resume that did not restore the RNG streams would diverge. Runs on CPU (AdamW path, Megatron's translation
written through DCP) and, with CUDA, on Megatron's optimizer and save.
"""

from __future__ import annotations

import random
import re

import numpy as np
import pytest
import torch
from transformers import NemotronHConfig

from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
from unified_models.backends.megatron.checkpoint import (
    TRACKER_FILE,
    get_rng_state,
    latest_iteration,
    load_training_checkpoint,
    save_training_checkpoint,
)
from unified_models.backends.megatron.optimizer import OptimizerConfig, build_optimizer
from unified_models.dsl import CheckpointError
from unified_models.models import spec_from_hf_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
K = 3
OPT = OptimizerConfig(lr=1e-3, weight_decay=0.1, adam_beta2=0.99, clip_grad=0.5)


@pytest.fixture(scope="module")
def hf_config():
    return NemotronHConfig(hybrid_override_pattern="*-", hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, intermediate_size=128, vocab_size=256,
                           dtype="bfloat16")


@pytest.fixture(scope="module")
def spec(hf_config):
    init_parallel_state()
    s = spec_from_hf_config(hf_config)
    assert s.dtype == torch.bfloat16
    return s


def _fresh(spec, seed=0):
    torch.manual_seed(seed)
    model = UnifiedMegatronModel(spec, device=DEVICE)
    return model, build_optimizer(model, OPT)


def _train_step(model, opt) -> dict:
    """One policy-gradient-like update through the module; the batch consumes all three RNG streams."""
    ids = torch.randint(0, model.spec.vocab_size, (24,)).to(DEVICE)  # torch RNG
    cu = torch.tensor([0, 9, 24], dtype=torch.int32, device=DEVICE)
    adv = torch.tensor([random.random() - 0.5, float(np.random.rand()) - 0.5], device=DEVICE)  # python, numpy
    opt.zero_grad()
    lp = model.token_logprobs(ids, cu)  # rows with a next token: 8 + 14
    loss = -(lp * torch.repeat_interleave(adv, torch.tensor([8, 14], device=DEVICE))).sum()
    loss.backward()
    return opt.step()


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _snapshot(model, opt):
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    mains = {n: t.detach().clone() for n, t in opt.main_params().items()}
    state = {n: {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in s.items()}
             for n, s in opt.param_state().items()}
    return params, mains, state


def _assert_same(a, b):
    for part, (x, y) in zip(("params", "main params", "optimizer state"), zip(a, b)):
        assert x.keys() == y.keys(), part
        for n in x:
            if isinstance(x[n], dict):
                assert x[n].keys() == y[n].keys(), (part, n)
                for k in x[n]:
                    assert torch.equal(torch.as_tensor(x[n][k]), torch.as_tensor(y[n][k])), (part, n, k)
            else:
                assert x[n].dtype == y[n].dtype and torch.equal(x[n], y[n]), (part, n)


def _rng_equal(a: dict, b: dict) -> bool:
    return (a["random_rng_state"] == b["random_rng_state"]
            and all(np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
                    for x, y in zip(a["np_rng_state"], b["np_rng_state"]))
            and torch.equal(a["torch_rng_state"], b["torch_rng_state"]))


def test_optimizer_steps_in_place_with_fp32_main_weights(spec):
    model, opt = _fresh(spec)
    try:
        ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        _seed_all(1)
        stats = _train_step(model, opt)
        assert stats["update_successful"] and stats["iteration"] == 1 and stats["grad_norm"] > 0
        assert stats["lr"] == OPT.lr
        moved = []
        for n, p in model.named_parameters():
            main = opt.main_params()[n]
            assert p.data_ptr() == ptrs[n], n
            assert main.dtype == torch.float32 and not torch.equal(main, before[n].float()), f"{n} did not move"
            # bf16 model weights are the fp32 main weights rounded to nearest even (a norm weight
            # at 1.0 moved by 1e-3 stays 1.0 in bf16: the fp32 main weight keeps the update)
            assert torch.equal(p, main.to(torch.bfloat16)), n
            moved.append(not torch.equal(p, before[n]))
        assert sum(moved) >= len(moved) - 3
        # Megatron's groups: weight decay on matrices only (biases / 1-D params get wd_mult 0)
        wds = {g["weight_decay"] for g in opt._inners()[0].param_groups}
        assert wds == {0.0, OPT.weight_decay}
    finally:
        opt.close()


def test_gradient_clipping_and_nan_refusal(spec):
    model, opt = _fresh(spec)
    try:
        opt.zero_grad()
        (sum((p.float() * 1e3).sum() for p in model.parameters())).backward()
        main_grads = [p.main_grad.clone() for p in model.parameters()]
        stats = opt.step()
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in main_grads])))
        assert stats["grad_norm"] == pytest.approx(norm, rel=1e-5)
        clipped = torch.linalg.vector_norm(torch.stack([m.grad.norm() for m in opt.main_params().values()]))
        assert float(clipped) == pytest.approx(OPT.clip_grad, rel=1e-4)

        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.zero_grad()
        victim = next(iter(model.parameters()))
        (victim.float().sum() * float("nan")).backward()
        with pytest.raises(FloatingPointError, match="NaN"):
            opt.step()
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())
    finally:
        opt.close()


def test_bad_config_and_double_optimizer(spec):
    with pytest.raises(ValueError, match="lr"):
        OptimizerConfig(lr=0.0)
    with pytest.raises(ValueError, match="adam_beta2"):
        OptimizerConfig(adam_beta2=1.0)
    torch.manual_seed(0)
    model = UnifiedMegatronModel(spec, device=DEVICE)
    opt = build_optimizer(model, OPT, backend="torch_adamw")  # the CPU path (also runs on CUDA)
    with pytest.raises(RuntimeError, match="already has an optimizer"):
        build_optimizer(model, OPT)
    opt.close()  # removes the gradient hooks: a new optimizer may take over
    build_optimizer(model, OPT, backend="torch_adamw").close()
    with pytest.raises(ValueError, match="backend"):
        build_optimizer(model, OPT, backend="sgd")
    if DEVICE == "cpu":
        with pytest.raises(RuntimeError, match="needs the model on CUDA"):
            build_optimizer(model, OPT, backend="megatron")


def test_resume_equals_uninterrupted_run(spec, hf_config, tmp_path):
    root = tmp_path / "ckpt"
    # uninterrupted: k steps, save, two more
    _seed_all(123)
    model, opt = _fresh(spec, seed=7)
    for _ in range(K):
        _train_step(model, opt)
    rng_at_save = get_rng_state()
    out = save_training_checkpoint(root, model, opt, iteration=K, hf_config=hf_config.to_dict(),
                                   extra={"prompt_cursor": 17})
    assert out.name == f"iter_{K:07d}" and latest_iteration(root) == K
    assert (root / TRACKER_FILE).read_text().strip() == str(K)
    assert _rng_equal(get_rng_state(), rng_at_save)  # saving consumes no randomness
    at_save = _snapshot(model, opt)
    for _ in range(2):
        _train_step(model, opt)
    uninterrupted = _snapshot(model, opt)
    opt.close()
    probe_ids = torch.arange(3, 40, device=DEVICE) % spec.vocab_size
    probe_cu = torch.tensor([0, 12, 37], dtype=torch.int32, device=DEVICE)
    with torch.no_grad():
        probe = model.token_logprobs(probe_ids, probe_cu)

    # resumed: a fresh model and optimizer (other init, other RNG), load, two more
    _seed_all(999)
    model2, opt2 = _fresh(spec, seed=8)
    info = load_training_checkpoint(root, model2, opt2)
    assert info.iteration == K and info.path == out and info.extra == {"prompt_cursor": 17}
    assert opt2.iteration == K
    assert _rng_equal(get_rng_state(), rng_at_save)
    _assert_same(_snapshot(model2, opt2), at_save)
    for _ in range(2):
        stats = _train_step(model2, opt2)
    assert stats["iteration"] == K + 2
    _assert_same(_snapshot(model2, opt2), uninterrupted)
    with torch.no_grad():
        assert torch.equal(model2.token_logprobs(probe_ids, probe_cu), probe)
    opt2.close()


def test_training_checkpoint_is_a_model_checkpoint(spec, hf_config, tmp_path):
    """With hf_config, the training checkpoint converts to Hugging Face and loads into a module."""
    from safetensors.torch import load_file

    from unified_models.backends.megatron.dist_ckpt import megatron_to_hf

    model, opt = _fresh(spec, seed=3)
    _seed_all(0)
    _train_step(model, opt)
    out = save_training_checkpoint(tmp_path / "c", model, opt, hf_config=hf_config.to_dict())
    hf = megatron_to_hf(out, tmp_path / "hf")
    back = load_file(str(hf / "model.safetensors"))
    assert all(torch.equal(back[n], p.detach().cpu()) for n, p in model.named_parameters())
    fresh = UnifiedMegatronModel(spec, device=DEVICE)
    fresh.load_dist_checkpoint(out)
    assert all(torch.equal(q, p) for (_, q), (_, p) in zip(fresh.named_parameters(), model.named_parameters()))
    opt.close()


def test_bad_resumes(spec, hf_config, tmp_path):
    model, opt = _fresh(spec)
    _seed_all(0)
    _train_step(model, opt)
    root = tmp_path / "r"
    save_training_checkpoint(root, model, opt)
    with pytest.raises(CheckpointError, match="already exists"):
        save_training_checkpoint(root, model, opt)
    with pytest.raises(ValueError, match="JSON"):
        save_training_checkpoint(root, model, opt, iteration=5, extra={"x": object()})
    assert not (root / "iter_0000005").exists()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_training_checkpoint(tmp_path / "nope", model, opt)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_training_checkpoint(root, model, opt, iteration=9)
    # a model-only checkpoint has no training state
    from unified_models.backends.megatron.dist_ckpt import save_dist_checkpoint

    mdir = save_dist_checkpoint({n: p.detach().cpu() for n, p in model.named_parameters()},
                                hf_config.to_dict(), tmp_path / "m", writer="torch_dcp")
    with pytest.raises(CheckpointError, match="not a unified_models training checkpoint"):
        load_training_checkpoint(mdir, model, opt)
    # another model
    other_cfg = NemotronHConfig(hybrid_override_pattern="*-", hidden_size=64, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=256,
                                dtype="bfloat16")
    other = UnifiedMegatronModel(spec_from_hf_config(other_cfg), device=DEVICE)
    other_opt = build_optimizer(other, OPT)
    with pytest.raises(CheckpointError, match="another model.*mis-shaped"):
        load_training_checkpoint(root, other, other_opt)
    # a tracker file pointing nowhere / garbage
    (root / TRACKER_FILE).write_text("garbage")
    with pytest.raises(CheckpointError, match="iteration number"):
        load_training_checkpoint(root, model, opt)
    other_opt.close()
    opt.close()


@pytest.fixture
def model_dir(tmp_path):
    """A Hugging Face directory's non-weight files: the bundled tokenizer, a generation config and files
    that are no asset (config.json, weights, a README)."""
    import shutil

    from unified_models.presets import tokenizer_dir

    d = tmp_path / "model"
    shutil.copytree(tokenizer_dir(), d)
    (d / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}\n')
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"not read")
    (d / "README.md").write_text("not an asset")
    return d


def test_training_checkpoint_carries_the_tokenizer_files(spec, hf_config, model_dir, tmp_path):
    """With assets_from, the checkpoint holds the model's tokenizer and generation files in hf_assets/
    (byte for byte: the bundled tokenizer covers the vocabulary, so nothing is padded), converts back
    with them, and resumes as before."""
    from unified_models.backends.megatron.dist_ckpt import megatron_to_hf

    assets = ["generation_config.json", "tokenizer.json", "tokenizer_config.json"]
    model, opt = _fresh(spec, seed=3)
    _seed_all(0)
    _train_step(model, opt)
    at_save = _snapshot(model, opt)
    out = save_training_checkpoint(tmp_path / "c", model, opt, iteration=1, hf_config=hf_config.to_dict(),
                                   assets_from=model_dir)
    assert sorted(p.name for p in (out / "hf_assets").iterdir()) == assets
    hf = megatron_to_hf(out, tmp_path / "hf")
    assert sorted(p.name for p in hf.iterdir()) == sorted(["config.json", "model.safetensors", *assets])
    for name in assets:
        assert (hf / name).read_bytes() == (model_dir / name).read_bytes(), name
    model2, opt2 = _fresh(spec, seed=9)
    assert load_training_checkpoint(tmp_path / "c", model2, opt2).iteration == 1
    _assert_same(_snapshot(model2, opt2), at_save)
    opt.close()
    opt2.close()


def test_tokenizer_from_replaces_the_models_tokenizer_files(spec, model_dir, tmp_path):
    """With tokenizer_from, hf_assets/ holds that directory's tokenizer files and none of assets_from's (no
    mix of two tokenizers) and its generation_config.json over the model's; one without tokenizer files is
    refused before anything is written."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes() + b"\n")
    (tok / "generation_config.json").write_text('{"eos_token_id": 7}\n')
    model, opt = _fresh(spec, seed=3)
    out = save_training_checkpoint(tmp_path / "c", model, opt, iteration=1, assets_from=model_dir, tokenizer_from=tok)
    assert sorted(p.name for p in (out / "hf_assets").iterdir()) == ["generation_config.json", "tokenizer.json"]
    for name in ("generation_config.json", "tokenizer.json"):
        assert (out / "hf_assets" / name).read_bytes() == (tok / name).read_bytes(), name
    (tok / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(f"tokenizer_from {tok} holds no tokenizer files")):
        save_training_checkpoint(tmp_path / "d", model, opt, iteration=1, assets_from=model_dir, tokenizer_from=tok)
    assert not (tmp_path / "d").exists()
    opt.close()


def test_assets_that_cannot_be_written_leave_no_checkpoint(spec, hf_config, model_dir, tmp_path, monkeypatch):
    """A missing assets_from is refused before anything is written; a copy that fails leaves neither a
    half-written iter_* directory nor a tracker pointing at one."""
    from unified_models.converters import megatron_dist_ckpt

    model, opt = _fresh(spec, seed=3)
    root = tmp_path / "c"
    with pytest.raises(CheckpointError, match=re.escape(f"assets_from {tmp_path / 'nope'} is not a directory")):
        save_training_checkpoint(root, model, opt, iteration=1, assets_from=tmp_path / "nope")
    assert not root.exists()
    save_training_checkpoint(root, model, opt, iteration=1, assets_from=model_dir)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(megatron_dist_ckpt, "copy_assets", broken)
    with pytest.raises(CheckpointError, match="iter_0000002 failed: copying the tokenizer files of .*disk full"):
        save_training_checkpoint(root, model, opt, iteration=2, assets_from=model_dir)
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", TRACKER_FILE] and latest_iteration(root) == 1
    opt.close()


def test_a_flipped_bit_in_a_model_tensor_is_refused_on_resume_and_convert(spec, hf_config, tmp_path):
    """The SHA-256 of every model tensor is stored at save time: a bit flipped inside a stored tensor's
    bytes in a ``.distcp`` file (found by its contents; a readable file) is refused by the resume and by
    ``convert --from megatron``, naming the tensor; the intact checkpoint loads."""
    from unified_models.backends.megatron.dist_ckpt import megatron_to_hf
    from unified_models.converters import megatron_dist_ckpt as layout

    model, opt = _fresh(spec, seed=5)
    _seed_all(0)
    _train_step(model, opt)
    out = save_training_checkpoint(tmp_path / "c", model, opt, hf_config=hf_config.to_dict())
    name = "backbone.embeddings.weight" if "backbone.embeddings.weight" in dict(model.named_parameters()) else \
        max(model.named_parameters(), key=lambda kv: kv[1].numel())[0]
    payload = dict(model.named_parameters())[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    fresh, fresh_opt = _fresh(spec, seed=6)
    load_training_checkpoint(out, fresh, fresh_opt)  # intact: loads
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(fresh.named_parameters(), model.named_parameters()))
    hits = []
    for f in sorted(out.glob("*.distcp")):
        data = f.read_bytes()
        at = data.find(payload[:4096])
        if at >= 0:
            hits.append((f, at + 1000))
    assert len(hits) == 1, f"{name}'s bytes not found once in the .distcp files ({len(hits)})"
    f, at = hits[0]
    data = bytearray(f.read_bytes())
    data[at] ^= 0x10  # one bit of one weight
    f.write_bytes(bytes(data))
    assert layout.check_layout_files(out)  # the files themselves still read
    fresh, fresh_opt = _fresh(spec, seed=6)
    with pytest.raises(CheckpointError, match=rf"corrupt: the data of 1 tensor\(s\).*{re.escape(name)}"):
        load_training_checkpoint(out, fresh, fresh_opt)
    with pytest.raises(CheckpointError, match=rf"corrupt.*{re.escape(name)}"):
        megatron_to_hf(out, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    # another dtype is named as such (it read as 27 corrupt tensors, or Adam's KeyError before the digests)
    import dataclasses

    wide, wide_opt = UnifiedMegatronModel(dataclasses.replace(spec, dtype=torch.float32), device=DEVICE), None
    wide_opt = build_optimizer(wide, OPT)
    with pytest.raises(CheckpointError, match=r"in another dtype than this model's parameters: .*torch.bfloat16; "
                                              r"the model's torch.float32"):
        load_training_checkpoint(out, wide, wide_opt)
    # tampered digest table: named as malformed metadata
    common = torch.load(out / "common.pt", weights_only=False)
    common[layout.COMMON_KEY]["sha256"] = ["not", "a", "table"]
    torch.save(common, out / "common.pt")
    with pytest.raises(CheckpointError, match="stored tensor digests are malformed"):
        load_training_checkpoint(out, fresh, fresh_opt)
    for o in (opt, fresh_opt, wide_opt):
        o.close()


@pytest.mark.parametrize("field", ["exp_avg_sq", "fp32_param"])
def test_a_flipped_bit_in_the_optimizer_state_is_refused_on_resume(spec, tmp_path, field):
    """The optimizer state (fp32 main weights, Adam's moments) has its own SHA-256 table: a bit flipped
    in one stored moment or main weight is refused by the resume, naming the tensor, before the state is
    applied (iteration, RNG); the intact checkpoint loads."""
    model, opt = _fresh(spec, seed=5)
    _seed_all(0)
    _train_step(model, opt)
    out = save_training_checkpoint(tmp_path / "c", model, opt)
    name = max(model.named_parameters(), key=lambda kv: kv[1].numel())[0]
    t = opt.main_params()[name] if field == "fp32_param" else opt.param_state()[name][field]
    flat = t.detach().cpu().contiguous().view(-1)
    payload = flat.view(torch.uint8).numpy().tobytes()
    start = max(0, int(flat.abs().argmax()) * flat.element_size() - 2048)  # a window around the largest value:
    window = payload[start:start + 4096]  # distinctive (rows of zero moments repeat in every moment tensor)
    fresh, fresh_opt = _fresh(spec, seed=6)
    load_training_checkpoint(out, fresh, fresh_opt)  # intact: loads
    hits = [(f, f.read_bytes().find(window)) for f in sorted(out.glob("*.distcp"))]
    hits = [(f, at + min(2048, len(window) - 1)) for f, at in hits if at >= 0]
    assert len(hits) == 1, f"{name}'s {field} bytes not found once in the .distcp files ({len(hits)})"
    f, at = hits[0]
    data = bytearray(f.read_bytes())
    data[at] ^= 0x10
    f.write_bytes(bytes(data))
    fresh, fresh_opt = _fresh(spec, seed=6)
    with pytest.raises(CheckpointError, match=rf"corrupt: 1 optimizer-state tensor\(s\).*{field}.*{re.escape(name)}"):
        load_training_checkpoint(out, fresh, fresh_opt)
    assert fresh_opt.iteration == 0  # the read state was not applied (the tensors may hold read values: rebuild)
    for o in (opt, fresh_opt):
        o.close()
