"""The single forward: packing invariance and agreement with the oracle, also with RoPE."""

import dataclasses

import torch

from numerics_helpers import BF16_LOGPROB_ULPS, logprob_error_ulps
from unified_models.backends.reference import ReferenceModel
from unified_models.dsl import AttentionSpec, RopeSpec
from unified_models.forward import forward_hidden, forward_logprobs
from unified_models.state import FlatBatch
from unified_models.private_state import PrivateStateStore


def _with_rope(spec):
    return spec.map_mixers(
        lambda m: dataclasses.replace(m, rope=RopeSpec(theta=10000.0, rotary_dim=32)) if isinstance(m, AttentionSpec)
        else m).replace(max_position_embeddings=512)


def _logprobs(spec, sd, seqs, block_size):
    ids = torch.cat(seqs)
    cu = torch.tensor([0] + [len(s) for s in seqs]).cumsum(0)
    batch = FlatBatch.from_cu_seqlens(ids, cu)
    store = PrivateStateStore(spec, [len(s) for s in seqs], block_size=block_size)
    store.bind(batch)
    lp = forward_logprobs(spec, sd, forward_hidden(spec, sd, batch, store))
    return [lp[int(cu[i]):int(cu[i + 1])] for i in range(len(seqs))]


def test_packing_invariance_and_oracle_with_rope(tiny_model):
    _, spec, sd = tiny_model
    spec = _with_rope(spec)
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 32000, (n,), generator=g) for n in (33, 1, 70, 16)]
    packed = _logprobs(spec, sd, seqs, 64)
    reordered = _logprobs(spec, sd, seqs[::-1], 16)[::-1]
    alone = [_logprobs(spec, sd, [s], 32)[0] for s in seqs]
    for a, b, c in zip(packed, reordered, alone):
        assert torch.equal(a, b) and torch.equal(a, c)
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    # bf16 forward vs fp64 oracle in bf16 ulps at the row's logit scale (tests/numerics_helpers.py):
    # measured 5.3 here (<= 5.8 on the other sequences). This model is near-uniform (logit std
    # 0.32), so a forward without RoPE is only 26.7 off here: tests/test_peaked_models.py has the
    # mutation tests, on models where it is >= 162.
    ulps = logprob_error_ulps(packed[2], ref.logits(seqs[2])).max().item()
    print(f"ULPS tiny preset with RoPE, bf16 vs fp64: {ulps:.2f} (bound {BF16_LOGPROB_ULPS})")
    assert ulps < BF16_LOGPROB_ULPS
    # RoPE really changes the result (positions matter), so the test can fail.
    plain = ReferenceModel(tiny_model[1], dtype=torch.float64)
    plain.load_state_dict_hf(sd)
    assert (plain.logprobs(seqs[2]) - ref.logprobs(seqs[2])).abs().max() > 1e-3
