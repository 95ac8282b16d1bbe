"""Peer correctness: our spec's math vs transformers' own NemotronHForCausalLM."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from unified_models.backends.reference import ReferenceModel
from unified_models.forward import forward_hidden, forward_logprobs
from unified_models.state import FlatBatch
from unified_models.private_state import PrivateStateStore


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(str(tiny_checkpoint), dtype=torch.float32).eval()


def test_reference_fp32_matches_transformers(tiny_model, hf_model):
    _, spec, sd = tiny_model
    ref = ReferenceModel(spec, dtype=torch.float32)
    ref.load_state_dict_hf(sd)
    g = torch.Generator().manual_seed(0)
    for n in (1, 17, 90):
        ids = torch.randint(0, 32000, (n,), generator=g)
        with torch.no_grad():
            theirs = hf_model(ids[None]).logits[0].float()
        assert (ref.logits(ids) - theirs).abs().max().item() < 1e-4


def test_engine_forward_bf16_close_to_fp32_reference(tiny_model):
    """The bf16 single forward (the engines' path) stays near the fp32 oracle."""
    _, spec, sd = tiny_model
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    ids = torch.randint(0, 32000, (64,), generator=torch.Generator().manual_seed(1))
    batch = FlatBatch.from_cu_seqlens(ids, torch.tensor([0, 64]))
    store = PrivateStateStore(spec, [64], block_size=16)
    store.bind(batch)
    ours = forward_logprobs(spec, sd, forward_hidden(spec, sd, batch, store))
    oracle = ref.logprobs(ids).float()
    err = (ours - oracle).abs().max().item()
    assert 0 < err < 0.05  # bf16 activations: not exact, but close
