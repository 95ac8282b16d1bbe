"""UnifiedMegatronModel: names, Megatron hooks, packing invariance, parallel refusals, HF peer check."""

from __future__ import annotations

import pytest
import torch

import megatron.core  # noqa: E402,F401  (required: a missing install must fail, not skip)

from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from unified_models.backends.megatron import (  # noqa: E402
    UnifiedMegatronModel,
    init_parallel_state,
    transformer_config_from_spec,
)
from unified_models.backends.megatron import compat  # noqa: E402
from unified_models.dsl import ParallelismError  # noqa: E402

PEER_TOLERANCE = 0.05
"""Max |logprob(ours, bf16) - logprob(transformers fp32)|; measured on the tiny preset:
0.0054 over next-token logprobs and 0.012 over full vocabulary rows."""


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint


@pytest.fixture(scope="module")
def loaded(tiny_model):
    _, spec, state_dict = tiny_model
    return spec, state_dict


@pytest.fixture(scope="module")
def model(loaded):
    init_parallel_state()
    spec, state_dict = loaded
    m = UnifiedMegatronModel(spec, device="cpu")
    m.load_hf_state_dict(state_dict)
    m.requires_grad_(False)
    return m


def _random_seqs(lens, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


def _pack(seqs):
    ids = torch.cat(seqs)
    cu = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()], dtype=torch.int32)
    return ids, cu


def test_named_parameters_are_the_spec_names(model, loaded):
    spec, _ = loaded
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert list(shapes) == list(spec.parameter_shapes())
    assert shapes == spec.parameter_shapes()
    assert all(p.dtype == spec.dtype for p in model.parameters())
    assert set(model.state_dict()) == set(spec.parameter_shapes())


def test_megatron_hooks_and_config(model, loaded):
    spec, _ = loaded
    assert model.model_type == ModelType.encoder_or_decoder
    assert model.set_input_tensor([None]) is None
    cfg = model.config
    assert isinstance(cfg, TransformerConfig)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (len(spec.blocks), 256, 4)
    assert cfg.bf16 and cfg.params_dtype == torch.bfloat16
    assert cfg.hidden_dropout == 0.0 and cfg.attention_dropout == 0.0
    assert (cfg.tensor_model_parallel_size, cfg.context_parallel_size, cfg.expert_model_parallel_size) == (1, 1, 1)
    for p in model.parameters():  # what Megatron's grad norm / optimizer read
        assert p.tensor_model_parallel is False and p.partition_dim == -1
    assert model.backbone.embeddings.weight.is_embedding_or_output_parameter


def test_sharded_state_dict_keys_and_replicas(model, loaded):
    spec, _ = loaded
    params = dict(model.named_parameters())
    ssd = model.sharded_state_dict()
    assert list(ssd) == list(spec.parameter_shapes())
    for name, st in ssd.items():
        assert st.key == name
        assert st.data is params[name]  # optimizer state is matched by id(data)
        assert st.global_shape == spec.parameter_shapes()[name]
        assert st.replica_id == (0, 0, 0)
    prefixed = model.sharded_state_dict(prefix="model.")
    assert all(k.startswith("model.") and v.key == k for k, v in prefixed.items())


def test_packing_invariance_bitwise(model):
    """Every sequence's logprobs and hidden rows are bitwise equal whatever it is packed with."""
    lens = [1, 5, 16, 17, 33]
    seqs = _random_seqs(lens, seed=1)
    alone = {}
    with torch.no_grad():
        for i, s in enumerate(seqs):
            ids, cu = _pack([s])
            hidden = model(ids, cu)
            if len(s) > 1:
                tok, full = model.token_logprobs(ids, cu, return_full=True)
            else:
                tok, full = torch.zeros(0), torch.zeros(0, model.spec.vocab_size)
            alone[i] = (hidden, tok, full)

        compositions = [[0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4], [3, 1], [1, 4, 0, 3, 2]]
        for order in compositions:
            ids, cu = _pack([seqs[i] for i in order])
            hidden = model(ids, cu)
            tok, full = model.token_logprobs(ids, cu, return_full=True)
            h_off, r_off = 0, 0
            for i in order:
                n = len(seqs[i])
                assert torch.equal(hidden[h_off:h_off + n], alone[i][0]), (order, i)
                assert torch.equal(tok[r_off:r_off + n - 1], alone[i][1]), (order, i)
                assert torch.equal(full[r_off:r_off + n - 1], alone[i][2]), (order, i)
                h_off += n
                r_off += n - 1

        # Megatron's micro-batch form: one [1, T] row + PackedSeqParams with padding after each sequence.
        order = [2, 4, 1]
        pad = 3
        parts, padded_cu, real_cu = [], [0], [0]
        for i in order:
            parts += [seqs[i], torch.zeros(pad, dtype=seqs[i].dtype)]
            padded_cu.append(padded_cu[-1] + len(seqs[i]) + pad)
            real_cu.append(real_cu[-1] + len(seqs[i]))
        ids = torch.cat(parts).view(1, -1)
        psp = PackedSeqParams(qkv_format="thd",
                              cu_seqlens_q=torch.tensor(real_cu, dtype=torch.int32),
                              cu_seqlens_kv=torch.tensor(real_cu, dtype=torch.int32),
                              cu_seqlens_q_padded=torch.tensor(padded_cu, dtype=torch.int32),
                              cu_seqlens_kv_padded=torch.tensor(padded_cu, dtype=torch.int32),
                              max_seqlen_q=max(len(seqs[i]) for i in order) + pad,
                              max_seqlen_kv=max(len(seqs[i]) for i in order) + pad)
        hidden = model(ids, packed_seq_params=psp)
        assert hidden.shape == (1, ids.shape[1], model.spec.hidden_size)
        for b, i in enumerate(order):
            start, n = padded_cu[b], len(seqs[i])
            assert torch.equal(hidden[0, start:start + n], alone[i][0])
            rows = torch.arange(start, start + n - 1)
            assert torch.equal(model.token_logprobs(ids, rows=rows, packed_seq_params=psp), alone[i][1])


def test_token_logprobs_rows_mask_and_targets(model):
    seqs = _random_seqs([6, 9], seed=2)
    ids, cu = _pack(seqs)
    with torch.no_grad():
        tok, full = model.token_logprobs(ids, cu, return_full=True)
        assert tok.dtype == torch.float32 and full.dtype == torch.float32
        assert tok.shape == (13,) and full.shape == (13, model.spec.vocab_size)
        assert torch.allclose(full.exp().sum(-1), torch.ones(13), atol=1e-4)
        mask = torch.zeros(15, dtype=torch.bool)
        mask[[2, 7]] = True
        by_mask = model.token_logprobs(ids, cu, mask)
        by_rows = model.token_logprobs(ids, cu, torch.tensor([2, 7]))
        assert torch.equal(by_mask, by_rows)
        assert torch.equal(by_rows, tok[[2, 6]])  # row 7 is the 2nd sequence's row 1 -> index 5 + 1
        with pytest.raises(ValueError, match="last token of their sequence"):
            model.token_logprobs(ids, cu, torch.tensor([5]))
        last = model.token_logprobs(ids, cu, torch.tensor([5]), target_ids=torch.tensor([11]))
        assert last.shape == (1,)
        explicit = model.token_logprobs(ids, cu, torch.tensor([4]), target_ids=ids[5:6])
        assert torch.equal(explicit, tok[4:5])
        hot = model.token_logprobs(ids, cu, torch.tensor([3]), temperature=0.5)
        assert hot.dtype == torch.float32
        with pytest.raises(ValueError, match="outside"):
            model.token_logprobs(ids, cu, torch.tensor([15]))
        with pytest.raises(ValueError, match="cu_seqlens"):
            model(ids, torch.tensor([0, 20], dtype=torch.int32))


def test_tensor_parallel_refused(loaded, monkeypatch):
    spec, _ = loaded
    with pytest.raises(ParallelismError, match="tensor_model_parallel_size=2"):
        init_parallel_state(tp=2)
    with pytest.raises(ParallelismError, match="tensor_model_parallel_size=2"):
        transformer_config_from_spec(spec, tensor_model_parallel_size=2)
    for kw, name in [(dict(pp=2), "pipeline_model_parallel_size=2"), (dict(cp=2), "context_parallel_size=2")]:
        with pytest.raises(ParallelismError, match=name):
            init_parallel_state(**kw)
    cfg = TransformerConfig(num_layers=len(spec.blocks), hidden_size=spec.hidden_size, num_attention_heads=4,
                            tensor_model_parallel_size=2, bf16=True, params_dtype=torch.bfloat16)
    with pytest.raises(ParallelismError, match="tensor_model_parallel_size=2"):
        UnifiedMegatronModel(spec, cfg, device="cpu")
    # A process launched with TP=2 in Megatron's parallel state is refused at construction and forward.
    sizes = dict(compat.parallel_sizes(), tensor_model_parallel_size=2)
    monkeypatch.setattr(compat, "parallel_sizes", lambda: sizes)
    with pytest.raises(ParallelismError, match="tensor_model_parallel_size=2"):
        UnifiedMegatronModel(spec, device="cpu")


def test_peer_transformers_fp32(model, checkpoint):
    """Our bf16 trainer logprobs agree with transformers' NemotronHForCausalLM in fp32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    assert type(hf).__name__ == "NemotronHForCausalLM"
    seqs = _random_seqs([7, 23, 40], seed=3)
    ids, cu = _pack(seqs)
    with torch.no_grad():
        tok, full = model.token_logprobs(ids, cu, return_full=True)
        ref_tok, ref_full = [], []
        for s in seqs:
            lp = torch.log_softmax(hf(s.view(1, -1)).logits[0].double(), dim=-1)[:-1]
            ref_full.append(lp)
            ref_tok.append(lp.gather(1, s[1:].view(-1, 1)).view(-1))
    ref_tok, ref_full = torch.cat(ref_tok), torch.cat(ref_full)
    tok_diff = (tok.double() - ref_tok).abs().max().item()
    full_diff = (full.double() - ref_full).abs().max().item()
    assert tok_diff < PEER_TOLERANCE, tok_diff
    assert full_diff < PEER_TOLERANCE, full_diff
    # The check discriminates: the logprobs vary across tokens by more than the tolerance.
    assert (ref_tok - ref_tok.mean()).abs().max().item() > 2 * PEER_TOLERANCE


@pytest.mark.gpu
def test_cuda_module_packing_invariance_and_peer(loaded, checkpoint):
    """On CUDA the module runs the Triton kernels: packing stays bitwise invariant and agrees with HF."""
    from transformers import AutoModelForCausalLM

    init_parallel_state()
    spec, state_dict = loaded
    m = UnifiedMegatronModel(spec, device="cuda")
    m.load_hf_state_dict(state_dict)
    m.requires_grad_(False)
    seqs = [s.cuda() for s in _random_seqs([1, 5, 16, 17, 33], seed=1)]
    with torch.no_grad():
        alone = [m.token_logprobs(*_pack([s])) if len(s) > 1 else None for s in seqs]
        for order in ([0, 1, 2, 3, 4], [4, 3, 2, 1, 0], [2, 0, 4]):
            ids, cu = _pack([seqs[i] for i in order])
            tok = m.token_logprobs(ids, cu)
            off = 0
            for i in order:
                n = len(seqs[i]) - 1
                if n:
                    assert torch.equal(tok[off:off + n], alone[i]), (order, i)
                off += n
        hf = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).cuda().eval()
        ids, cu = _pack(seqs[2:])
        tok = m.token_logprobs(ids, cu)
        ref = torch.cat([torch.log_softmax(hf(s.view(1, -1)).logits[0].double(), -1)[:-1]
                         .gather(1, s[1:].view(-1, 1)).view(-1) for s in seqs[2:]])
    assert (tok.double() - ref).abs().max().item() < PEER_TOLERANCE
