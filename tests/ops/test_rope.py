"""RoPE: kernel / CPU implementation vs the fp64 oracle and transformers; invariance."""

import pytest
import torch

from unified_models.ops.rope import apply_rope, apply_rope_reference, apply_rope_torch, rope_cos_sin


from invariance import Inv

_bits = Inv.bits


@pytest.mark.parametrize("rotary_dim,head_dim", [(64, 64), (32, 64)])
def test_rope_matches_transformers_llama(rotary_dim, head_dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    t, h = 40, 3
    q = torch.randn(t, h, head_dim, generator=g, dtype=torch.float64)
    pos = torch.arange(t)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    ang = pos.double()[:, None] * inv
    emb = torch.cat([ang, ang], -1)
    qr, _ = apply_rotary_pos_emb(q[None, :, :, :rotary_dim].transpose(1, 2), q[None, :, :, :rotary_dim].transpose(1, 2),
                                 emb.cos()[None], emb.sin()[None])
    theirs = torch.cat([qr[0].transpose(0, 1), q[..., rotary_dim:]], -1)
    assert torch.allclose(apply_rope_reference(q, pos, rotary_dim, 10000.0), theirs, atol=1e-12)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_rope_close_to_oracle_and_batch_invariant(impl, monkeypatch):
    if impl == "triton":
        monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    g = torch.Generator().manual_seed(1)
    t, h, e, rd = 37, 4, 64, 48
    x = torch.randn(t, h, e, generator=g).bfloat16()
    pos = torch.randint(0, 500, (t,), generator=g)
    cos, sin = rope_cos_sin(512, rd, 10000.0)
    out = apply_rope(x, pos, cos, sin)
    ref = apply_rope_reference(x, pos, rd, 10000.0)
    assert (out.float() - ref.float()).abs().max() <= 2 ** -7 * ref.float().abs().max()
    assert torch.equal(out[..., rd:], x[..., rd:])
    perm = torch.randperm(t, generator=g)
    assert torch.equal(_bits(apply_rope(x[perm], pos[perm], cos, sin)), _bits(out[perm]))
    assert torch.equal(_bits(apply_rope(x[5:6], pos[5:6], cos, sin)), _bits(out[5:6]))


def test_rope_torch_and_triton_round_once_the_same_fp32_math(monkeypatch):
    """Both implementations compute x1*c - x2*s in fp32 and round once; on CPU
    (interpreter, no FMA contraction) they agree to the bit."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 2, 32, generator=g).bfloat16()
    pos = torch.arange(9)
    cos, sin = rope_cos_sin(16, 32, 500000.0)
    a = apply_rope_torch(x, pos, cos, sin)
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    b = apply_rope(x, pos, cos, sin)
    assert torch.equal(_bits(a), _bits(b))


def test_rope_bad_input():
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(8, 7, 10000.0)
    cos, sin = rope_cos_sin(8, 16, 10000.0)
    with pytest.raises(ValueError, match="cannot take"):
        apply_rope(torch.zeros(2, 1, 8), torch.zeros(2, dtype=torch.long), cos, sin)
