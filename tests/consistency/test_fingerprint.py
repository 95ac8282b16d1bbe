"""Fingerprints (:mod:`unified_models.consistency.fingerprint`): the execution contract of each
engine and the weight checksum after every in-place sync.

* the checksum equals an independent numpy uint64 computation, does not depend on the chunking,
  and changes on any single-bit flip and on any swap of two different elements;
* a changed kernel config (a patched constant) or library version (a patched version read)
  changes the contract fingerprint and :func:`compare` refuses naming the component, the entry
  and both values; ``check`` refuses (exit 2) when one engine's fingerprint differs, and
  reports both engines' equal fingerprints when they agree;
* an ``rl`` run whose weight sync leaves one element of one tensor wrong in vLLM's buffers
  stops (exit 1) naming the tensor and the step.
"""

import json
import re

import numpy as np
import pytest
import torch

from unified_models.consistency import fingerprint as F
from unified_models.consistency.fingerprint import (FingerprintMismatchError, WeightFingerprintError, compare,
                                                    contract_fingerprint, tensor_checksum, tensor_checksums,
                                                    verify_weight_sync)


def _numpy_checksum(t: torch.Tensor) -> int:
    """sum_i bits_i (2i + 1) mod 2**64 in numpy uint64 (wrap-around is defined for unsigned numpy)."""
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[t.element_size()]
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().view(width).astype(np.uint64)
    w = np.arange(raw.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    with np.errstate(over="ignore"):
        return int(np.sum(raw * w, dtype=np.uint64))


def _u64(t: torch.Tensor) -> int:
    return int(tensor_checksum(t)) & ((1 << 64) - 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.uint8, torch.int64,
                                   torch.float64])
def test_checksum_equals_a_numpy_reference_over_chunks(dtype, monkeypatch):
    g = torch.Generator().manual_seed(0)
    n = 3 * 1006  # > 3 chunks of 1000 below
    if dtype in (torch.uint8, torch.int64):
        t = torch.randint(-(2 ** 62) if dtype == torch.int64 else 0, 2 ** 62 if dtype == torch.int64 else 256,
                          (n,), generator=g, dtype=dtype)
    else:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 100).to(dtype)
    t = t.reshape(3, -1)
    ref = _numpy_checksum(t)
    assert _u64(t) == ref != 0
    monkeypatch.setattr(F, "CHECKSUM_CHUNK", 1000)  # 4 chunks (weights rebuilt for the new chunk)
    monkeypatch.setattr(F, "_ODD_WEIGHTS", {})
    assert _u64(t) == ref
    strided = t.reshape(-1)[1::2]  # a non-contiguous view: read in element order
    assert tensor_checksums([("a", t), ("b", strided)]) == {"a": ref, "b": _numpy_checksum(strided.contiguous())}


def test_checksum_sees_every_single_bit_flip_and_every_swap():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 48, generator=g).bfloat16()
    base = _u64(w)
    bits = w.view(torch.int16).reshape(-1)
    for i in (0, 1, 777, bits.numel() - 1):
        for b in range(16):
            flipped = bits.clone()
            flipped[i] ^= torch.tensor(1 << b if b < 15 else -(1 << 15), dtype=torch.int16)
            assert _u64(flipped.view(torch.bfloat16)) != base, (i, b)
    f32 = torch.randn(1000, generator=g)
    for b in range(32):
        x = f32.view(torch.int32).clone()
        x[500] ^= torch.tensor(1 << b if b < 31 else -(1 << 31), dtype=torch.int32)
        assert _u64(x.view(torch.float32)) != _u64(f32), b
    flat = w.reshape(-1)
    for i, j in ((0, 1), (5, 3000), (0, flat.numel() - 1)):
        assert flat[i] != flat[j]
        swapped = flat.clone()
        swapped[i], swapped[j] = flat[j], flat[i]
        assert _u64(swapped) != base, (i, j)
        assert sorted(swapped.tolist()) == sorted(flat.tolist())  # same multiset: a plain sum would miss it


def test_verify_weight_sync_names_the_tensor_and_the_step():
    a = {"x.weight": 1, "y.weight": 2}
    fp = verify_weight_sync(a, dict(a), step=4)
    assert fp.tensors_checked == 2 and len(fp.digest) == 64
    with pytest.raises(WeightFingerprintError, match=r"step 7: 1 of 2 tensors differ.*y\.weight: trainer "
                                                     r"0000000000000002 vs engine 0000000000000003") as e:
        verify_weight_sync(a, {"x.weight": 1, "y.weight": 3}, step=7)
    assert e.value.tensors == ["y.weight"] and e.value.step == 7
    with pytest.raises(WeightFingerprintError, match="x.weight: trainer 0000000000000001 vs engine absent"):
        verify_weight_sync(a, {"y.weight": 2}, step=1)


# ----------------------------------------------------------------------------- contract fingerprint

@pytest.fixture(scope="module")
def two_engines(tiny_model):
    """The tiny model's fingerprints as the vLLM side and the Megatron side compute them
    (from the same spec and tensors, without starting engines)."""
    _, spec, state = tiny_model
    return spec, state, contract_fingerprint("vllm", spec, state, "cpu"), contract_fingerprint("megatron", spec, state,
                                                                                                "cpu")


def test_equal_contracts_compare_and_engine_components_stay_apart(two_engines):
    spec, state, a, b = two_engines
    compare(a, b)
    assert a.digest == b.digest and a.engine_digest != b.engine_digest
    assert "vllm.source" in a.components and "megatron.source" in b.components
    assert a.components["kernel_path"] == "torch-cpu" and a.components["library.torch"] == torch.__version__
    assert "ops/linear/cpu.py" in a.components["kernel_source.linear"]
    assert not any("triton" in f or "reference" in f for f in a.components["kernel_source.linear"])
    assert a.components["kernel_config.shared"]["_dispatch.py:ROW_TILE"] == "16"
    d = a.as_dict()
    assert d["digest"] == a.digest and d["values"]["library.torch"] == torch.__version__


def test_a_changed_kernel_config_changes_the_fingerprint_and_is_refused_by_name(two_engines, monkeypatch):
    spec, state, a, _ = two_engines
    from unified_models.ops import _dispatch

    monkeypatch.setattr(_dispatch, "ROW_TILE", 32)
    b = contract_fingerprint("megatron", spec, state, "cpu")
    assert b.digest != a.digest
    with pytest.raises(FingerprintMismatchError, match=r"component 'kernel_config.shared' entry "
                                                       r"'_dispatch.py:ROW_TILE': vllm 16 vs megatron 32") as e:
        compare(a, b)
    assert e.value.component == "kernel_config.shared" and e.value.values == ("16", "32")


def test_a_changed_triton_tile_config_is_refused_by_name(tiny_model, monkeypatch):
    """The Triton path (GPU, or UM_OPS_BACKEND=triton) hashes the kernels and their tiles."""
    _, spec, state = tiny_model
    monkeypatch.setenv("UM_OPS_BACKEND", "triton")
    a = contract_fingerprint("vllm", spec, state, "cpu")
    assert a.components["kernel_path"].startswith("triton") and a.components["library.triton"] != "absent"
    assert "ops/linear/triton.py" in a.components["kernel_source.linear"]
    from unified_models.ops.linear import triton as linear_triton

    cfg = linear_triton.INTERPRETER_CONFIG
    monkeypatch.setattr(linear_triton, "INTERPRETER_CONFIG", type(cfg)(cfg.block_m, cfg.block_n, cfg.block_k,
                                                                       cfg.num_warps * 2, cfg.num_stages))
    b = contract_fingerprint("megatron", spec, state, "cpu")
    with pytest.raises(FingerprintMismatchError, match=r"'kernel_config.linear' entry "
                                                       r"'linear/triton.py:INTERPRETER_CONFIG'.*num_warps"):
        compare(a, b)


def test_a_changed_library_version_is_refused_by_name(two_engines, monkeypatch):
    spec, state, a, _ = two_engines
    real = F.library_version
    monkeypatch.setattr(F, "library_version", lambda m: "2.0.0+other" if m == "torch" else real(m))
    b = contract_fingerprint("megatron", spec, state, "cpu")
    with pytest.raises(FingerprintMismatchError,
                       match=rf"component 'library.torch': vllm {re.escape(torch.__version__)} vs megatron 2\.0\.0\+other"):
        compare(a, b)


def test_engine_own_components_compare_between_two_engines_of_one_kind(two_engines):
    _, _, a, _ = two_engines
    other = a.with_component("vllm.version", "0.0.1")
    assert other.digest == a.digest  # not part of the shared contract ...
    with pytest.raises(FingerprintMismatchError, match="'vllm.version'"):
        compare(a, other)  # ... but two vLLM engines must agree on it


@pytest.mark.slow
def test_check_reports_equal_fingerprints_and_refuses_a_different_one(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """End to end on the tiny preset (1 prompt x 2 tokens): both live engines' fingerprints are in
    the report and agree; with the trainer reading another torch version, check exits 2 naming it."""
    from unified_models.backends.megatron.trainer import Trainer
    from unified_models.cli import main

    argv = ["check", "--model", str(tiny_checkpoint), "--num-prompts", "1", "--max-new-tokens", "2",
            "--peer-prompts", "1"]
    out = tmp_path / "ok.json"
    assert main(argv + ["--json", str(out)]) == 0
    r = json.loads(out.read_text())
    fps = r["fingerprints"]
    assert fps["rollout"]["engine"] == "vllm" and fps["trainer"]["engine"] == "megatron"
    assert fps["contract"] == fps["rollout"]["digest"] == fps["trainer"]["digest"]
    assert fps["rollout"]["values"]["vllm.settings"]["logprobs_mode"].endswith("raw_logits")
    assert "contract fingerprint" in capsys.readouterr().out

    original = Trainer.contract_fingerprint

    def other_torch(self):
        real = F.library_version
        with monkeypatch.context() as m:
            m.setattr(F, "library_version", lambda mod: "2.0.0+other" if mod == "torch" else real(mod))
            return original(self)

    monkeypatch.setattr(Trainer, "contract_fingerprint", other_torch)
    refused = tmp_path / "refused.json"
    assert main(argv + ["--json", str(refused)]) == 2
    err = capsys.readouterr().err.replace("\n", " ")
    assert "library.torch" in err and torch.__version__ in err and "2.0.0+other" in err
    assert not refused.exists()  # refused before any diff or report


@pytest.mark.slow
def test_rl_stops_naming_the_tensor_and_step_when_a_sync_corrupts_one_element(tiny_checkpoint, tiny_model, tmp_path,
                                                                               monkeypatch, capsys):
    """vLLM's copy of the step-2 sync leaves one bit of one tensor wrong: the weight fingerprint
    catches it before step 3 and names the tensor and step 2 (exit 1); step 1's line carries both
    fingerprints."""
    from unified_models.backends.vllm.weight_loading import WeightLoading
    from unified_models.cli import main
    from unified_models.rl.metrics import read_metrics

    original = WeightLoading.copy_weights
    calls, corrupted = [], []

    def corrupting_copy(self, prepared):
        loaded = original(self, prepared)
        calls.append(len(prepared))
        if len(calls) == 3:  # 1: the engine's first load, 2: step 1's sync, 3: step 2's sync
            name = sorted(prepared)[-1]
            bits = self.params()[name].data.view(-1).view(torch.int16)
            bits[7] ^= 1
            corrupted.append(name)
        return loaded

    monkeypatch.setattr(WeightLoading, "copy_weights", corrupting_copy)
    metrics = tmp_path / "m.jsonl"
    status = main(["rl", "--model", str(tiny_checkpoint), "--num-prompts-per-step", "1", "--group-size", "2",
                   "--max-new-tokens", "3", "--full-vocab-rows", "2", "--seed", "3", "--lr", "1e-3", "--steps", "3",
                   "--metrics", str(metrics), "--no-plot"])
    assert status == 1 and len(corrupted) == 1
    err = capsys.readouterr().err.replace("\n", " ")
    assert "weight fingerprint mismatch after the weight sync of step 2" in err and corrupted[0] in err
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2]
    _, spec, _ = tiny_model
    assert rows[0]["weight_fingerprint_tensors"] == len(spec.parameter_shapes())  # every tensor, copied or not
    assert "kernel_source.linear" in rows[0]["contract_fingerprint_components"]
    assert len(rows[0]["weight_fingerprint"]) == 64 and rows[0]["contract_fingerprint"] == rows[1]["contract_fingerprint"]
    assert rows[1]["weight_fingerprint_mismatch"] == [corrupted[0]]
