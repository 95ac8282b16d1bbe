"""The check pipeline's two halves on a non-default checkpoint: fp32 weights,
GQA 4:1, pattern ``-*--*``. Both engines must pick the dtype from the same spec."""

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

from unified_models.backends.megatron.trainer import recompute_logprobs
from unified_models.backends.vllm.rollout import rollout
from unified_models.converters.hf_safetensors import spec_and_state_dict

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory):
    cfg = NemotronHConfig(hybrid_override_pattern="-*--*", hidden_size=96, num_attention_heads=8,
                          num_key_value_heads=2, head_dim=16, intermediate_size=160, vocab_size=512,
                          eos_token_id=2, pad_token_id=0, bos_token_id=1)
    torch.manual_seed(3)
    d = tmp_path_factory.mktemp("fp32") / "m"
    NemotronHForCausalLM(cfg).to(torch.float32).save_pretrained(d)
    return d


def test_fp32_checkpoint_rollout_equals_recompute(fp32_checkpoint):
    _, spec, sd = spec_and_state_dict(fp32_checkpoint)
    assert spec.dtype == torch.float32
    prompts = [[1, 5, 9, 11, 40], [1, 7], list(range(3, 70))]
    ro = rollout(fp32_checkpoint, prompts, max_new_tokens=12, seed=5, device=DEVICE)
    assert [len(c) for c in ro.completions] == [12, 12, 12]
    tr = recompute_logprobs(spec, sd, prompts, ro.completions, full_rows_for=ro.full_row_keys, device=DEVICE)
    rollout_lp = torch.cat([torch.tensor(x, dtype=torch.float32) for x in ro.logprobs])
    assert torch.equal(rollout_lp, torch.cat(tr.logprobs))
    assert len(ro.full_row_keys) == 36
    for k in ro.full_row_keys:
        assert torch.equal(ro.full_rows[k], tr.full_rows[k])
    # the trainer really runs in fp32: a bf16 copy of the weights gives other logprobs
    _, spec16, sd16 = spec_and_state_dict(fp32_checkpoint, dtype=torch.bfloat16)
    tr16 = recompute_logprobs(spec16, sd16, prompts, ro.completions, device=DEVICE)
    assert not torch.equal(rollout_lp, torch.cat(tr16.logprobs))


def test_temperature_is_applied_by_the_logprob_op_on_both_sides(fp32_checkpoint):
    """Requests at different temperatures in one batch: the reported logprob is
    ops.logprobs(logits, T) on the rollout side and on the trainer side."""
    from unified_models.backends.reference import ReferenceModel
    from unified_models.backends.vllm.engine import make_llm, shutdown_llm
    from unified_models.backends.vllm.sampling import generate_token_ids, sampling_params

    _, spec, sd = spec_and_state_dict(fp32_checkpoint)
    prompts = [[1, 5, 9, 11, 40], [1, 7, 8], [3, 4]]
    temps = [0.6, 1.0, 1.7]
    llm = make_llm(fp32_checkpoint, seed=0, max_model_len=64, max_num_seqs=3, skip_tokenizer_init=True,
                   max_logprobs=0, gpu=DEVICE == "cuda")
    try:
        params = [sampling_params(temperature=t, seed=11 + i, max_tokens=10, ignore_eos=True, logprobs=0,
                                  detokenize=False) for i, t in enumerate(temps)]
        outs = generate_token_ids(llm, prompts, params)
        # vLLM's own `temperature` is the request's temperature too: moved into the logprob op
        # (sampling.adopt_request_temperature), the same tokens and bits as the extra_args form
        from vllm import SamplingParams

        (plain,) = generate_token_ids(llm, [prompts[0]], SamplingParams(
            temperature=temps[0], seed=11, max_tokens=10, ignore_eos=True, logprobs=0, detokenize=False))
        assert list(plain.outputs[0].token_ids) == list(outs[0].outputs[0].token_ids)
        assert [s[t].logprob for t, s in zip(plain.outputs[0].token_ids, plain.outputs[0].logprobs)] == \
            [s[t].logprob for t, s in zip(outs[0].outputs[0].token_ids, outs[0].outputs[0].logprobs)]
    finally:
        shutdown_llm(llm)
    ref = ReferenceModel(spec, dtype=torch.float64)
    ref.load_state_dict_hf(sd)
    for p, t, out in zip(prompts, temps, outs):
        toks = list(out.outputs[0].token_ids)
        got = torch.tensor([step[tok].logprob for tok, step in zip(toks, out.outputs[0].logprobs)], dtype=torch.float32)
        same = recompute_logprobs(spec, sd, [p], [toks], temperature=t, device=DEVICE).logprobs[0]
        assert torch.equal(got, same)
        if t != 1.0:
            assert not torch.equal(got, recompute_logprobs(spec, sd, [p], [toks], device=DEVICE).logprobs[0])
        # and it is log_softmax(logits / T) of the published math
        full = torch.tensor(p + toks)
        oracle = ref.logprobs(full, temperature=t)[len(p) - 1:-1].gather(1, torch.tensor(toks)[:, None]).view(-1)
        assert (got.double() - oracle).abs().max() < 1e-4
