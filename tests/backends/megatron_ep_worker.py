"""Worker of ``tests/backends/test_megatron_expert_parallel.py``, started by ``torchrun --nproc-per-node 2``.

Megatron's parallel state over gloo with ``expert_model_parallel_size=2``: each rank holds 4 of the
8 routed experts of every MoE layer of the ``nemotron_h_hybrid_tiny`` preset and recomputes its own
block of sequences (``shard_sequences``); tokens reach the other rank's experts through
``AllToAllExperts`` over Megatron's EP group. Results go to ``OUT`` as files (one per rank) and the
EP = 1 comparison runs on rank 0 in the same job:

* ``logprobs``: bf16, fp32 and bf16-with-NVFP4-experts (W4A16 masters quantized in the op) token
  logprobs and full-vocabulary rows at EP = 2 vs EP = 1, bitwise;
* ``grads``: fp32 gradients of the summed token logprobs at EP = 2 (dense: the two ranks' partial
  gradients summed in fp64, what the data-parallel reduction does; experts: the owner's) vs EP = 1;
* ``checkpoint``: one AdamW step at EP = 2, a training checkpoint saved at EP = 2 and reloaded at
  EP = 1 (parameters, fp32 main weights, Adam moments bitwise), saved again at EP = 1 and
  reloaded at EP = 2 (bitwise), and the logprobs after the reload equal before.

* other families (``TAG=CHECKPOINT`` arguments: SwiGLU experts, Qwen3-MoE / DeepSeek-V4): bf16
  logprobs and full rows bitwise, fp32 gradients, EP = 2 vs EP = 1.

``python megatron_ep_worker.py CHECKPOINT OUT [TAG=CHECKPOINT ...]`` (under torchrun); CHECKPOINT
``-`` runs only the other families. Writes ``OUT/report.json`` (rank 0).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

LENS = [9, 14, 6, 11]
TEMPERATURE = 0.9


def batch(idx):
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 32000, (n,), generator=g) for n in LENS]
    chosen = [seqs[i] for i in idx]
    cu = torch.tensor([0, *torch.tensor([len(s) for s in chosen]).cumsum(0).tolist()], dtype=torch.int32)
    return torch.cat(chosen), cu


def nvfp4_experts(spec):
    """The routed experts as NVFP4 masters (W4A16, quantized by ModelOpt's rule inside the op)."""
    from unified_models.dsl import MoESpec
    from unified_models.dsl.weights import LinearFormat

    return spec.with_weight_formats({m.expert_linear(e, p): LinearFormat("nvfp4", stored=False)
                                     for m in (s.mixer for s in spec.sublayers_of(MoESpec))
                                     for e in range(m.n_routed_experts) for p in ("up_proj", "down_proj")})


def pieces_with_digest(ckpt_dir, model, opt) -> list[int]:
    """``[pieces with a stored digest, pieces]`` of the optimizer state this layout reads from ``ckpt_dir``
    (saved at another EP size): the resume compares only pieces whose place the save recorded."""
    from unified_models.backends.megatron.checkpoint import _fragment_id, _sharded_tensors
    from unified_models.converters.megatron_dist_ckpt import COMMON_KEY

    stored = torch.load(Path(ckpt_dir) / "common.pt", weights_only=False)[COMMON_KEY]["optimizer_sha256"]
    ids = [_fragment_id(t) for _, t in _sharded_tensors(opt.sharded_state_dict(model.sharded_state_dict(),
                                                                                is_loading=True))]
    return [sum(i in stored for i in ids), len(ids)]


def build(ckpt, dtype, ep, nvfp4=False):
    from unified_models.backends.megatron import UnifiedMegatronModel
    from unified_models.backends.megatron.module import transformer_config_from_spec
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    _, spec, sd = spec_and_state_dict(ckpt, dtype=dtype)
    spec = nvfp4_experts(spec) if nvfp4 else spec
    cfg = transformer_config_from_spec(spec, expert_model_parallel_size=ep, perform_initialization=False)
    model = UnifiedMegatronModel(spec, cfg, device="cpu")
    model.load_hf_state_dict(sd)
    return model


def bits(t):
    t = t.detach().contiguous()
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.float64: torch.int64}[t.dtype])


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def opt_state(opt) -> dict:
    """``{name: {"main": fp32 main weight, "exp_avg": ..., "exp_avg_sq": ..., "step": ...}}`` (copies)."""
    mains = opt.main_params()
    return {n: {"main": mains[n].detach().clone(), **{k: v.clone() for k, v in s.items() if torch.is_tensor(v)}}
            for n, s in opt.param_state().items()}


def log(rank, report, key):
    if key in report:
        print(f"[rank {rank}] {key}: {json.dumps(report[key], default=str)}", flush=True)


def other_family(ckpt: str, tag: str, out: Path, report: dict) -> None:
    """SwiGLU-expert families (Qwen3-MoE, DeepSeek-V4): bf16 logprobs and full rows at EP = 2 vs EP = 1
    bitwise, fp32 gradients at EP = 2 vs EP = 1 (as the hybrid's)."""
    from unified_models.backends.megatron.parallel import shard_sequences

    rank, world = dist.get_rank(), dist.get_world_size()
    mine, everyone = list(shard_sequences(len(LENS), rank, world)), list(range(len(LENS)))
    model = build(ckpt, torch.bfloat16, 2)
    with torch.no_grad():
        tok, full = model.token_logprobs(*batch(mine), temperature=TEMPERATURE, return_full=True)
    report[f"{tag}_rows_sent_remote_rank{rank}"] = model._dispatcher.rows_sent_remote
    torch.save({"tok": tok, "full": full}, out / f"{tag}_lp_rank{rank}.pt")
    del model
    model = build(ckpt, torch.float32, 2)
    model.token_logprobs(*batch(mine), temperature=TEMPERATURE).sum().backward()
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out / f"{tag}_grad_rank{rank}.pt")
    del model
    dist.barrier()
    if rank == 0:
        parts = [torch.load(out / f"{tag}_lp_rank{r}.pt") for r in range(world)]
        ref = build(ckpt, torch.bfloat16, 1)
        with torch.no_grad():
            tok1, full1 = ref.token_logprobs(*batch(everyone), temperature=TEMPERATURE, return_full=True)
        ep2_tok, ep2_full = torch.cat([p["tok"] for p in parts]), torch.cat([p["full"] for p in parts])
        res = {"tokens": int(tok1.numel()), "bitwise_tokens": same(ep2_tok, tok1),
               "bitwise_full_rows": same(ep2_full, full1),
               "max_abs_diff": float((ep2_tok.double() - tok1.double()).abs().max())}
        ref = build(ckpt, torch.float32, 1)
        ref.token_logprobs(*batch(everyone), temperature=TEMPERATURE).sum().backward()
        grads = [torch.load(out / f"{tag}_grad_rank{r}.pt") for r in range(world)]
        errs = {}
        for n, p in ref.named_parameters():
            if p.grad is None:
                continue
            have = [g[n] for g in grads if n in g]
            g2 = have[0].double() if ".experts." in n else sum(h.double() for h in have)
            want = p.grad.double()
            errs[n] = float((g2 - want).norm() / want.norm()) if float(want.norm()) else float((g2 - want).norm())
        worst = max(errs, key=errs.get)
        res.update(grad_parameters=len(errs), grad_bitwise=sum(e == 0.0 for e in errs.values()),
                   grad_worst_rel_err=errs[worst], grad_worst_param=worst,
                   grad_worst_expert_rel_err=max(e for n, e in errs.items() if ".experts." in n))
        report[f"{tag}"] = res
        log(rank, report, tag)
    dist.barrier()


def hybrid(ckpt: str, out: Path, report: dict) -> None:
    """The hybrid preset's logprobs, gradients and checkpoint round trip (module doc)."""
    from unified_models.backends.megatron.checkpoint import load_training_checkpoint, save_training_checkpoint
    from unified_models.backends.megatron.optimizer import OptimizerConfig, build_optimizer
    from unified_models.backends.megatron.parallel import destroy_parallel_state, init_parallel_state, shard_sequences

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(shard_sequences(len(LENS), rank, world))
    everyone = list(range(len(LENS)))
    t0 = time.time()

    # (a) logprobs at EP = 2 (each rank its sequences) vs EP = 1 (rank 0, every sequence)
    for dtype, nvfp4 in ((torch.bfloat16, False), (torch.float32, False), (torch.bfloat16, True)):
        name = str(dtype).split(".")[1] + ("_nvfp4_experts" if nvfp4 else "")
        model = build(ckpt, dtype, 2, nvfp4)
        held = sorted({n.split(".experts.")[1].split(".")[0] for n, _ in model.named_parameters() if ".experts." in n},
                      key=int)
        report[f"experts_rank{rank}"] = held
        ids, cu = batch(mine)
        with torch.no_grad():
            tok, full = model.token_logprobs(ids, cu, temperature=TEMPERATURE, return_full=True)
        report[f"rows_sent_remote_rank{rank}_{name}"] = model._dispatcher.rows_sent_remote
        report[f"moe_calls_rank{rank}_{name}"] = model._dispatcher.calls
        torch.save({"tok": tok, "full": full}, out / f"lp_{name}_rank{rank}.pt")
        dist.barrier()
        if rank == 0:
            parts = [torch.load(out / f"lp_{name}_rank{r}.pt") for r in range(world)]
            ep2_tok = torch.cat([p["tok"] for p in parts])
            ep2_full = torch.cat([p["full"] for p in parts])
            ref = build(ckpt, dtype, 1, nvfp4)
            ids1, cu1 = batch(everyone)
            with torch.no_grad():
                tok1, full1 = ref.token_logprobs(ids1, cu1, temperature=TEMPERATURE, return_full=True)
            d = (ep2_tok.double() - tok1.double()).abs()
            report[f"logprobs_{name}"] = {
                "tokens": int(tok1.numel()), "rows": list(full1.shape), "bitwise_tokens": same(ep2_tok, tok1),
                "bitwise_full_rows": same(ep2_full, full1), "max_abs_diff": float(d.max()),
                "full_max_abs_diff": float((ep2_full.double() - full1.double()).abs().max())}
            del ref
            log(rank, report, f"logprobs_{name}")
        dist.barrier()
    report["t_logprobs_s"] = round(time.time() - t0, 1)

    # (b) fp32 gradients of sum(token logprobs) at EP = 2 vs EP = 1
    t0 = time.time()
    model = build(ckpt, torch.float32, 2)
    ids, cu = batch(mine)
    model.token_logprobs(ids, cu, temperature=TEMPERATURE).sum().backward()
    torch.save({n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out / f"grad_rank{rank}.pt")
    expert_marks = {n: getattr(p, "allreduce", True) for n, p in model.named_parameters()}
    dist.barrier()
    if rank == 0:
        parts = [torch.load(out / f"grad_rank{r}.pt") for r in range(world)]
        ref = build(ckpt, torch.float32, 1)
        ids1, cu1 = batch(everyone)
        ref.token_logprobs(ids1, cu1, temperature=TEMPERATURE).sum().backward()
        errs, exact, expert_errs = {}, 0, {}
        for n, p in ref.named_parameters():
            if p.grad is None:
                continue
            have = [g[n] for g in parts if n in g]
            if ".experts." in n:  # held by exactly one rank (its owner)
                assert len(have) == 1, (n, len(have))
                g2 = have[0].double()
            else:
                assert len(have) == world, (n, len(have))
                g2 = sum(h.double() for h in have)
            want = p.grad.double()
            err = float((g2 - want).norm() / want.norm()) if float(want.norm()) else float((g2 - want).norm())
            errs[n] = err
            exact += int(err == 0.0)
            if ".experts." in n:
                expert_errs[n] = err
        worst = max(errs, key=errs.get)
        report["grads_fp32"] = {"parameters": len(errs), "bitwise": exact, "worst_rel_err": errs[worst],
                                "worst_param": worst, "median_rel_err": sorted(errs.values())[len(errs) // 2],
                                "worst_expert_rel_err": max(expert_errs.values()),
                                "expert_params_marked_allreduce_false": not any(
                                    v for n, v in expert_marks.items() if ".experts." in n and "shared" not in n)}
        del ref
        log(rank, report, "grads_fp32")
    dist.barrier()
    report["t_grads_s"] = round(time.time() - t0, 1)

    # (b') the Trainer at EP = 2 with unequal micro-batch counts (rank 0: 2, rank 1: 1 at 20 tokens):
    # padding passes keep the ranks' all-to-alls paired; logprobs equal EP = 1's token logprobs
    from unified_models.backends.megatron.optimizer import OptimizerConfig as _Cfg
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
    from unified_models.converters.hf_safetensors import spec_and_state_dict

    t0 = time.time()
    _, spec, sd = spec_and_state_dict(ckpt)
    ids_all, _ = batch(everyone)
    seqs = list(torch.split(ids_all, LENS))
    prompts = [s[:3].tolist() for s in seqs]
    completions = [s[3:].tolist() for s in seqs]
    with Trainer(spec, sd, options=TrainerOptions(expert_model_parallel_size=2, micro_batch_tokens=20,
                                                  optimizer=_Cfg(lr=1e-4))) as trainer:
        res = trainer.logprobs([prompts[i] for i in mine], [completions[i] for i in mine], temperature=TEMPERATURE)
        stats = trainer.step([prompts[i] for i in mine], [completions[i] for i in mine],
                             lambda b: -b.logprobs.sum(), temperature=TEMPERATURE)
        n_mb = len(trainer.pack([prompts[i] for i in mine], [completions[i] for i in mine]))
    torch.save(res.logprobs, out / f"trainer_lp_rank{rank}.pt")
    report[f"trainer_micro_batches_rank{rank}"] = n_mb
    report[f"trainer_step_rank{rank}"] = {"grad_norm": stats["grad_norm"], "ok": stats["update_successful"]}
    dist.barrier()
    if rank == 0:
        got = [lp for r in range(world) for lp in torch.load(out / f"trainer_lp_rank{r}.pt")]
        want = torch.load(out / "lp_bfloat16_rank0.pt")["tok"], torch.load(out / "lp_bfloat16_rank1.pt")["tok"]
        want = torch.cat(want)
        offs = torch.tensor([0, *LENS]).sub(torch.tensor([0] + [1] * len(LENS))).cumsum(0).tolist()
        ok = all(same(got[s], want[offs[s] + 2: offs[s] + LENS[s] - 1]) for s in everyone)
        report["trainer_ep2_logprobs_bitwise"] = ok
        log(rank, report, "trainer_ep2_logprobs_bitwise")
    dist.barrier()
    report["t_trainer_s"] = round(time.time() - t0, 1)

    # (c) training checkpoint: save at EP = 2, reload at EP = 1 and back, bitwise
    t0 = time.time()
    cfg = OptimizerConfig(lr=1e-3)
    model = build(ckpt, torch.bfloat16, 2)
    opt = build_optimizer(model, cfg)
    opt.zero_grad()
    ids, cu = batch(mine)
    model.token_logprobs(ids, cu, temperature=TEMPERATURE).sum().backward()
    stats = opt.step()
    report["ep2_step_grad_norm"] = stats["grad_norm"]
    ep2_dir = save_training_checkpoint(out / "ckpt_ep2", model, opt, iteration=1)
    import torch as _t  # the stored digests cover every rank's experts (gathered), each matching its owner's tensor
    from unified_models.converters import megatron_dist_ckpt as _layout
    from unified_models.converters.megatron_dist_ckpt import COMMON_KEY as _CK

    _entry = _t.load(ep2_dir / "common.pt", weights_only=False)[_CK]
    report[f"ep2_digests_cover_every_tensor_rank{rank}"] = set(_entry["sha256"]) == set(model.spec.parameter_shapes())
    report[f"ep2_digests_match_local_rank{rank}"] = all(_entry["sha256"][n] == _layout.tensor_digest(p)
                                            for n, p in model.named_parameters())
    mine_state = {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "state": opt_state(opt)}
    torch.save(mine_state, out / f"state_ep2_rank{rank}.pt")
    with torch.no_grad():
        before = model.token_logprobs(*batch(mine), temperature=TEMPERATURE)
    opt.close()
    del model, opt
    dist.barrier()
    destroy_parallel_state()
    init_parallel_state(ep=1, backend="gloo")
    model1 = build(ckpt, torch.bfloat16, 1)
    opt1 = build_optimizer(model1, cfg)
    load_training_checkpoint(ep2_dir, model1, opt1)
    report[f"ep1_optimizer_pieces_with_digest_rank{rank}"] = pieces_with_digest(ep2_dir, model1, opt1)
    parts = [torch.load(out / f"state_ep2_rank{r}.pt") for r in range(world)]
    params2 = {n: t for p in parts for n, t in p["params"].items()}
    state2 = {n: s for p in parts for n, s in p["state"].items()}
    state1 = opt_state(opt1)
    ok_p = all(same(p, params2[n]) for n, p in model1.named_parameters()) and len(params2) == len(
        dict(model1.named_parameters()))
    ok_s = all(same(state1[n][k], v) for n, s in state2.items() for k, v in s.items())
    report[f"reload_ep2_to_ep1_rank{rank}"] = {"params_bitwise": ok_p, "optimizer_bitwise": ok_s,
                                               "params": len(params2), "iteration": opt1.iteration}
    log(rank, report, f"reload_ep2_to_ep1_rank{rank}")
    ep1_dir = save_training_checkpoint(out / "ckpt_ep1", model1, opt1, iteration=2)
    ep1_params = {n: p.detach().clone() for n, p in model1.named_parameters()}
    ep1_state = opt_state(opt1)
    opt1.close()
    del model1, opt1
    dist.barrier()
    destroy_parallel_state()
    init_parallel_state(ep=2, backend="gloo")
    model2 = build(ckpt, torch.bfloat16, 2)
    opt2 = build_optimizer(model2, cfg)
    load_training_checkpoint(ep1_dir, model2, opt2)
    report[f"ep2_optimizer_pieces_with_digest_rank{rank}"] = pieces_with_digest(ep1_dir, model2, opt2)
    st = opt_state(opt2)
    ok_p = all(same(p, ep1_params[n]) for n, p in model2.named_parameters())
    ok_s = all(same(v, ep1_state[n][k]) for n, s in st.items() for k, v in s.items())
    with torch.no_grad():
        after = model2.token_logprobs(*batch(mine), temperature=TEMPERATURE)
    report[f"reload_ep1_to_ep2_rank{rank}"] = {"params_bitwise": ok_p, "optimizer_bitwise": ok_s,
                                               "logprobs_after_reload_bitwise": same(before, after)}
    log(rank, report, f"reload_ep1_to_ep2_rank{rank}")
    report["t_checkpoint_s"] = round(time.time() - t0, 1)
    del model2, opt2


def main(ckpt: str, out: str, *others: str) -> None:
    from unified_models.backends.megatron import compat
    from unified_models.backends.megatron.parallel import destroy_parallel_state, init_parallel_state, shard_sequences

    out = Path(out)
    init_parallel_state(ep=2, backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert compat.expert_parallel_state()["ep_size"] == 2
    report: dict = {"ranks": world, "sequences": {r: list(shard_sequences(len(LENS), r, world)) for r in range(world)}}
    if ckpt != "-":  # "-": only the other families
        hybrid(ckpt, Path(out), report)
    for other in others:  # "tag=checkpoint_dir"
        t0 = time.time()
        tag, path = other.split("=", 1)
        other_family(path, tag, out, report)
        report[f"t_{tag}_s"] = round(time.time() - t0, 1)
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        merged = {}
        for r in reports:
            merged.update(r)
        (out / "report.json").write_text(json.dumps(merged, indent=1, default=str))
    dist.barrier()
    destroy_parallel_state(destroy_process_group=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
