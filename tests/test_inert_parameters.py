"""``ModelSpec.inert_parameters`` (tensors a checkpoint carries that no forward reads, e.g. DeepSeek-V4's
MTP layer): declared with their stored dtype, never trained, allocated frozen by the Megatron module,
loaded and returned bit for bit, refused when they clash with a component's name or are malformed, and
the forward's bits do not move."""

from __future__ import annotations

import pytest
import torch

import megatron.core  # noqa: F401  (required: a missing install must fail, not skip)

from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state
from unified_models.dsl import SpecError

from toy_models import trainer_logits

INERT = (("mtp.0.e_proj.weight", (8, 16), torch.bfloat16), ("mtp.0.hc_head_base", (4,), torch.float32))


@pytest.fixture(scope="module")
def specs(tiny_model):
    _, spec, state_dict = tiny_model
    return spec, spec.replace(inert_parameters=INERT), state_dict


def test_declared_with_dtype_and_untrained(specs):
    base, spec, _ = specs
    shapes, dtypes = spec.parameter_shapes(), spec.parameter_dtypes()
    assert list(shapes)[:len(base.parameter_shapes())] == list(base.parameter_shapes())
    assert shapes["mtp.0.e_proj.weight"] == (8, 16) and dtypes["mtp.0.hc_head_base"] == torch.float32
    assert {n for n, _, _ in INERT} <= spec.untrained_parameter_names()
    assert not ({n for n, _, _ in INERT} & base.untrained_parameter_names())


def test_megatron_module_holds_them_frozen_and_round_trips(specs):
    _, spec, state_dict = specs
    g = torch.Generator().manual_seed(0)
    full = dict(state_dict)
    for name, shape, dtype in INERT:
        full[name] = torch.randn(shape, generator=g).to(dtype)
    init_parallel_state()
    model = UnifiedMegatronModel(spec, device="cpu")
    model.load_hf_state_dict(full)
    params = dict(model.named_parameters())
    for name, _, dtype in INERT:
        assert not params[name].requires_grad and params[name].dtype == dtype
        assert torch.equal(params[name].detach(), full[name])
    assert all(params[n].requires_grad for n in state_dict if n not in spec.untrained_parameter_names())


def test_forward_ignores_them(specs):
    base, spec, state_dict = specs
    ids = torch.arange(10, 30)
    assert torch.equal(trainer_logits(spec, state_dict, ids), trainer_logits(base, state_dict, ids))


def test_refusals(specs):
    base, _, _ = specs
    clash = next(iter(base.parameter_shapes()))
    with pytest.raises(SpecError, match="also declared"):
        base.replace(inert_parameters=((clash, (1,), torch.bfloat16),))
    with pytest.raises(SpecError, match="not a shape"):
        base.replace(inert_parameters=(("mtp.x", (2, -1), torch.bfloat16),))
    with pytest.raises(SpecError, match="not a shape"):
        base.replace(inert_parameters=(("mtp.x", (2,), "bf16"),))


def test_speculative_decoding_is_refused(tmp_path):
    """MTP weights load as inert parameters; a draft model would sample by a computation the trainer never
    repeats, so asking the engine for speculative decoding is refused before anything is loaded."""
    from unified_models.backends.vllm.engine import make_llm

    with pytest.raises(ValueError, match="speculative decoding"):
        make_llm(tmp_path, speculative_config={"method": "mtp", "num_speculative_tokens": 1})
