"""UnifiedMegatronModel trains: gradients of the summed token logprobs on the tiny
preset vs plain PyTorch autograd of the fp64 reference model, values bitwise
equal to the no-grad recompute, and the weight-version guard at model level.

Error measure per parameter: ``||g - g_ref||_2 / ||g_ref||_2``; the test
asserts the worst over all parameters. Tolerances:

* fp32 spec: 1e-5 (fp32 kernels forward, fp32 backward; measured worst
  8.8e-7 over three batches);
* bf16 spec (the preset's dtype): 0.05. The reference differentiates the same
  bf16 weights in fp64, while our forward rounds every activation to bf16 and
  our gradients are bf16; measured worst 1.6e-2 (an attention ``k_proj``),
  median 9e-3, over three batches. A sign, transpose or temperature error in
  any backward gives errors of 0.1 or more.
"""

from __future__ import annotations

import inspect

import pytest
import torch

import megatron.core  # noqa: F401  (required: a missing install must fail, not skip)

from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
from unified_models.backends.reference import ReferenceModel
from unified_models.converters.hf_safetensors import spec_and_state_dict
from unified_models.ops import StaleWeightError, bump_weight_version

TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-2}
LENS = [7, 12]
TEMPERATURE = 0.9


def _batch():
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 32000, (n,), generator=g) for n in LENS]
    cu = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return seqs, torch.cat(seqs), cu


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def models(request, tiny_checkpoint):
    init_parallel_state()
    _, spec, sd = spec_and_state_dict(tiny_checkpoint, dtype=request.param)
    model = UnifiedMegatronModel(spec, device="cpu")
    model.load_hf_state_dict(sd)
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    return spec, model, ref


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit pattern (so -0.0 != +0.0)."""
    t = t.detach().contiguous()
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def _reference_grads(spec, ref):
    """fp64 autograd of sum over sequences of log p(next token), same temperature."""
    logits = inspect.unwrap(ReferenceModel.logits)  # the method without its no_grad decorator
    ref.params.requires_grad_(True)
    ref.zero_grad(set_to_none=True)
    seqs, _, _ = _batch()
    total = 0
    for ids in seqs:
        lp = torch.log_softmax(logits(ref, ids) / TEMPERATURE, dim=-1)
        total = total + lp[:-1].gather(1, ids[1:].view(-1, 1)).sum()
    total.backward()
    return {n: ref.p(n).grad for n in spec.parameter_shapes()}


def test_gradients_match_fp64_reference(models):
    spec, model, ref = models
    _, ids, cu = _batch()
    model.zero_grad(set_to_none=True)
    model.requires_grad_(True)
    model.token_logprobs(ids, cu, temperature=TEMPERATURE).sum().backward()
    want = _reference_grads(spec, ref)
    errs = {}
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == spec.dtype, name
        errs[name] = float((p.grad.double() - want[name]).norm() / want[name].norm())
    worst = max(errs, key=errs.get)
    print(f"GRAD-ERR model {spec.dtype}: worst {errs[worst]:.3e} ({worst}), "
          f"median {sorted(errs.values())[len(errs) // 2]:.3e}")
    assert errs[worst] <= TOL[spec.dtype], f"{worst}: rel. error {errs[worst]:.3e}"


def test_values_bitwise_equal_with_and_without_grad(models):
    spec, model, _ = models
    _, ids, cu = _batch()
    model.requires_grad_(True)
    with torch.no_grad():
        plain_tok, plain_full = model.token_logprobs(ids, cu, temperature=TEMPERATURE, return_full=True)
        plain_hidden = model(ids, cu)
    tok, full = model.token_logprobs(ids, cu, temperature=TEMPERATURE, return_full=True)
    hidden = model(ids, cu)
    assert tok.grad_fn is not None and hidden.grad_fn is not None
    for a, b, what in [(tok, plain_tok, "token logprobs"), (full, plain_full, "full rows"),
                       (hidden, plain_hidden, "hidden")]:
        assert torch.equal(bits(a), bits(b)), f"{what} differ with grad enabled"


def test_fused_token_logprobs_give_the_unfused_bits_and_gradients(models):
    """The trainer's path (``token_logprobs_and_rows``: LM head + logprob + gather in row chunks, the gradient
    written over the chunk's log-probabilities; one chunk at these sizes) gives the values and every parameter
    gradient of ``token_logprobs(return_full=True)``'s gathered logprobs bit for bit; its lazy full rows equal
    those rows."""
    spec, model, _ = models
    _, ids, cu = _batch()
    model.requires_grad_(True)
    adv = torch.linspace(-1.0, 1.0, sum(LENS) - len(LENS))

    def grads(fused):
        model.zero_grad(set_to_none=True)
        if fused:
            tok, rows_fn = model.token_logprobs_and_rows(ids, cu, temperature=TEMPERATURE)
        else:
            tok, _ = model.token_logprobs(ids, cu, temperature=TEMPERATURE, return_full=True)
        (tok * adv).sum().backward()
        return tok.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, rows_fn if fused else None

    tok_f, g_f, rows_fn = grads(True)
    tok_u, g_u, _ = grads(False)
    assert torch.equal(bits(tok_f), bits(tok_u))
    assert g_f.keys() == g_u.keys() and all(torch.equal(bits(g_f[n]), bits(g_u[n])) for n in g_f), \
        [n for n in g_f if not torch.equal(bits(g_f[n]), bits(g_u[n]))]
    assert any(float(g.abs().max()) > 0 for g in g_f.values())
    with torch.no_grad():
        _, full = model.token_logprobs(ids, cu, temperature=TEMPERATURE, return_full=True)
    assert torch.equal(bits(rows_fn()), bits(full))


def test_stale_weight_guard_names_the_parameter(models):
    spec, model, _ = models
    _, ids, cu = _batch()
    model.requires_grad_(True)
    name = "backbone.layers.0.mixer.q_proj.weight"
    p = model.get_parameter(name)
    loss = model.token_logprobs(ids, cu).sum()
    with torch.no_grad():
        p.mul_(1.0)  # any in-place write counts, even one that keeps the values
    with pytest.raises(StaleWeightError, match=rf"linear backward: weight '{name}'"):
        loss.backward()
    loss = model.token_logprobs(ids, cu).sum()
    p.data.mul_(1.0)  # the Megatron optimizer's way: through .data, announced by a bump
    bump_weight_version(model)
    with pytest.raises(StaleWeightError, match="weight version"):
        loss.backward()
