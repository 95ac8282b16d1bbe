"""`unified-models rl` end to end on CPU: diff = 0 at every step, plot written, resume
equals the uninterrupted run bitwise, the first diff != 0 stops the run, bad flags fail cleanly."""

import copy
import json

import pytest
import torch

from unified_models.cli import main
from unified_models.rl.metrics import REQUIRED_FIELDS, read_metrics

SMALL = ["--num-prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "6", "--full-vocab-rows", "12",
         "--seed", "3", "--lr", "1e-3"]
"""8 sequences x 6 tokens per step: seconds per step on two cores."""


def _diff_zero(row):
    return (row["max_abs_diff"] == 0.0 and row["mean_abs_diff"] == 0.0 and row["std_abs_diff"] == 0.0
            and row["k3_kl"] == 0.0 and row["num_mismatched"] == 0 and row["full_vocab_max_abs_diff"] == 0.0
            and row["importance_ratio_max"] == 1.0 and row["importance_ratio_min"] == 1.0)


@pytest.fixture(scope="module")
def uninterrupted(tiny_checkpoint, tmp_path_factory):
    """4 steps with checkpoints after steps 2 and 4."""
    d = tmp_path_factory.mktemp("rl_a")
    status = main(["rl", "--model", str(tiny_checkpoint), *SMALL, "--steps", "4", "--metrics", str(d / "m.jsonl"),
                   "--save", str(d / "ckpt"), "--save-every", "2"])
    return status, d, tiny_checkpoint


@pytest.mark.slow
def test_every_step_has_diff_zero_and_the_plot_is_written(uninterrupted, capsys):
    status, d, _ = uninterrupted
    assert status == 0
    rows = read_metrics(d / "m.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        for k in REQUIRED_FIELDS:
            assert k in r, k
        assert _diff_zero(r), r
        assert r["tokens"] == r["tokens_compared"] == 8 * 6 and r["full_vocab_rows"] >= 12
        assert r["old_logprobs"] == "recompute"
        assert set(r["seconds"]) >= {"rollout", "recompute", "update", "sync"}
        assert all(v >= 0 for v in r["seconds"].values())
        assert 0 <= r["reward_mean"] <= 1 and r["entropy"] > 0
        assert r["sync_tensors_copied"] > 0  # the update changed weights and they reached vLLM
    # the policy moved: the step-1 rollout and the later ones differ, and the target-token id was fixed once
    assert len({r["rollout_sha256"] for r in rows}) == 4
    assert len({r["target_token_id"] for r in rows}) == 1
    png = d / "m.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert (d / "ckpt" / "iter_0000002").is_dir() and (d / "ckpt" / "iter_0000004").is_dir()


def _trained_state(ckpt_dir, spec):
    """Parameters, fp32 main weights and Adam moments of a training checkpoint."""
    from unified_models.backends.megatron import UnifiedMegatronModel, init_parallel_state, transformer_config_from_spec
    from unified_models.backends.megatron.checkpoint import load_training_checkpoint
    from unified_models.backends.megatron.optimizer import OptimizerConfig, build_optimizer

    init_parallel_state(tp=1)
    model = UnifiedMegatronModel(spec, transformer_config_from_spec(spec, perform_initialization=True), device="cpu")
    opt = build_optimizer(model, OptimizerConfig(lr=1e-3))
    try:
        ck = load_training_checkpoint(ckpt_dir, model, opt)
        state = {f"param.{n}": p.detach().clone() for n, p in model.named_parameters()}
        state.update({f"main.{n}": t.detach().clone() for n, t in opt.main_params().items()})
        for n, st in opt.param_state().items():
            state.update({f"{k}.{n}": v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)})
        return ck.iteration, state
    finally:
        opt.close()


@pytest.mark.slow
def test_resume_equals_the_uninterrupted_run_bitwise(uninterrupted, tiny_model, tmp_path):
    """Resume from the step-2 checkpoint (with --use-rollout-logprobs, which the resumed
    process may use from its second step on): steps 3-4 sample the same tokens with the same
    logprob bits, and the final weights, fp32 main weights and Adam moments are equal bitwise.
    The metrics file lacks step 2's line (as when a run stops between its checkpoint and that line):
    the resume restores it from the checkpoint, and drops the later lines."""
    status, d, model_dir = uninterrupted
    assert status == 0
    _, spec, _ = tiny_model
    metrics = tmp_path / "resumed.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in read_metrics(d / "m.jsonl") if r["step"] != 2))
    assert main(["rl", "--model", str(model_dir), *SMALL,
                 "--steps", "4", "--metrics", str(metrics), "--resume", str(d / "ckpt" / "iter_0000002"),
                 "--save", str(tmp_path / "ckpt"), "--use-rollout-logprobs"]) == 0
    a, b = read_metrics(d / "m.jsonl"), read_metrics(metrics)
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # step 1 kept, 2 restored, 3-4 rewritten by the resumed run
    assert b[1].pop("restored_from_checkpoint") is True and "restored_from_checkpoint" not in b[0]
    assert b[1]["seconds"]["save"] == 0.0 and "step" not in b[1]["seconds"]  # as recorded before the save
    assert {k: v for k, v in b[1].items() if k != "seconds"} == {k: v for k, v in a[1].items() if k != "seconds"}
    assert [r["old_logprobs"] for r in b[2:]] == ["recompute", "rollout"]
    for ra, rb in zip(a[2:], b[2:]):
        assert _diff_zero(rb), rb
        for k in ("rollout_sha256", "reward_mean", "reward_std", "prompt_rows", "target_token_id", "entropy",
                  "grad_norm", "loss"):
            assert ra[k] == rb[k], k
    it_a, state_a = _trained_state(d / "ckpt", spec)
    it_b, state_b = _trained_state(tmp_path / "ckpt", spec)
    assert it_a == it_b == 4 and state_a.keys() == state_b.keys()
    for k in state_a:
        assert torch.equal(state_a[k], state_b[k]), k


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
"""What a preset's directory holds besides its config and weights (the bundled tokenizer, padded)."""


def _assert_same_assets(converted, source):
    """The converted checkpoint holds the source model's tokenizer and generation files, byte for byte,
    so `check --model` and `rl --model` on it tokenize with them (not the bundled fallback)."""
    from unified_models.run_options import tokenizer_dir_for

    for name in TOKENIZER_FILES:
        assert (source / name).is_file(), name
        assert (converted / name).read_bytes() == (source / name).read_bytes(), name
    assert tokenizer_dir_for(converted, None) == converted


@pytest.mark.slow
def test_saved_checkpoint_converts_with_the_models_tokenizer(uninterrupted, tmp_path):
    """`rl --save` writes the model's tokenizer files into every checkpoint (hf_assets/), and `convert
    --from megatron` of one gives them back byte for byte beside the trained weights."""
    status, d, model_dir = uninterrupted
    assert status == 0
    for it in ("iter_0000002", "iter_0000004"):
        assert sorted(p.name for p in (d / "ckpt" / it / "hf_assets").iterdir()) == sorted(TOKENIZER_FILES)
    out = tmp_path / "hf"
    assert main(["convert", "--from", "megatron", "--to", "hf", str(d / "ckpt" / "iter_0000004"), str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", "model.safetensors", *TOKENIZER_FILES])
    assert (out / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
    _assert_same_assets(out, model_dir)


def _other_tokenizer(model_dir, out):
    """A tokenizer directory beside the model's: its ``tokenizer.json`` and a ``tokenizer_config.json`` whose
    chat template starts every user turn with ``Q: `` (other bytes, other prompt ids); no generation config."""
    out.mkdir()
    (out / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    user = "'<|user|>\n' + message['content']"
    assert user in cfg["chat_template"]
    cfg["chat_template"] = cfg["chat_template"].replace(user, "'<|user|>\nQ: ' + message['content']")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    return out


@pytest.mark.slow
def test_saved_checkpoint_carries_the_runs_tokenizer(tiny_checkpoint, tmp_path):
    """`rl --tokenizer DIR --save` writes DIR's tokenizer files into hf_assets/ byte for byte, with the model's
    generation_config.json (DIR has none), not the model's tokenizer files; the run tokenized with DIR (its
    prompt ids differ from the model tokenizer's for every prompt), also on `--resume` with it; a resume
    without it is named as a difference from the saved run (its prompt tokens' sha256 is in the checkpoint)."""
    from unified_models.backends.megatron.checkpoint import _training_entry
    from unified_models.rl.options import RLOptions, resolve_options
    from unified_models.rl.startup import load_run, prompt_ids_sha256, prompts_file, resume_differences

    tok = _other_tokenizer(tiny_checkpoint, tmp_path / "tok")
    ck = tmp_path / "ck"
    assert main(["rl", "--model", str(tiny_checkpoint), "--tokenizer", str(tok), "--num-prompts-per-step", "1",
                 "--group-size", "2", "--max-new-tokens", "2", "--full-vocab-rows", "0", "--steps", "1", "--no-plot",
                 "--metrics", str(tmp_path / "m.jsonl"), "--save", str(ck)]) == 0
    assets = ck / "iter_0000001" / "hf_assets"
    want = {"tokenizer.json": tok, "tokenizer_config.json": tok, "generation_config.json": tiny_checkpoint}
    assert sorted(p.name for p in assets.iterdir()) == sorted(want)
    for name, src in want.items():
        assert (assets / name).read_bytes() == (src / name).read_bytes(), name
    assert (assets / "tokenizer_config.json").read_bytes() != (tiny_checkpoint / "tokenizer_config.json").read_bytes()

    def run(**flags):
        return load_run(resolve_options(RLOptions(model=str(tiny_checkpoint), num_prompts_per_step=2, steps=2,
                                                  **flags)))

    resumed, with_tok, plain = run(resume=str(ck), tokenizer=str(tok)), run(tokenizer=str(tok)), run()
    assert resumed.tokenizer_dir == with_tok.tokenizer_dir == tok and plain.tokenizer_dir == tiny_checkpoint
    assert resumed.prompt_ids == with_tok.prompt_ids
    assert len(plain.prompt_ids) == 200 and all(p != q for p, q in zip(plain.prompt_ids, resumed.prompt_ids))
    # the checkpoint records the prompts' tokens; a resume without the saved run's --tokenizer is named
    _, _, entry, _ = _training_entry(ck, None, plain.spec)
    saved = entry["extra"]["rl"]
    assert saved["tokenizer"] == str(tok) and saved["prompt_ids_sha256"] == prompt_ids_sha256(with_tok.prompt_ids)
    assert "prompt tokens" not in resume_differences(saved, resumed)  # (its other flags differ from the saved run's)
    pf = prompts_file(plain)
    assert saved["prompts_file"] == pf and "prompts" not in resume_differences(saved, plain)
    assert resume_differences(saved, plain)["prompt tokens"] == (f"{pf} tokenized with {tok}",
                                                                 f"{pf} tokenized with {tiny_checkpoint}")
    # another model config with the same tensors, another explicit target token, another micro-batch size
    eps = saved["model_config"]["layer_norm_epsilon"]
    other = dict(saved, model_config={**saved["model_config"], "layer_norm_epsilon": 0.1, "transformers_version": "0"},
                 target_token_id=5, micro_batch_tokens=16)  # (the writer's version is not compared)
    targeted = copy.copy(resumed)
    targeted.target_token_id = 7
    diff = resume_differences(other, targeted)
    assert diff["model config.json"] == ("layer_norm_epsilon=0.1", f"layer_norm_epsilon={eps!r}")
    assert diff["target_token_id"] == (5, 7) and diff["micro_batch_tokens"] == (16, None)


@pytest.mark.slow
@pytest.mark.parametrize("argv, message", [
    (["--steps", "4"], "is at step 4; --steps 4 leaves nothing to do"),
    (["--preset", "nemotron_h_hybrid_tiny", "--steps", "9"], "holds another model; missing tensors"),
])
def test_resume_refusals_come_before_any_engine(uninterrupted, argv, message, tmp_path, monkeypatch, capsys):
    """A resume with nothing left to do, or of another model's checkpoint, is refused from the
    checkpoint's metadata files before vLLM or the trainer start."""
    from unified_models.backends.vllm import rollout

    def no_engine(*a, **k):
        raise AssertionError("an engine started before the resume checks")

    monkeypatch.setattr(rollout, "RolloutEngine", no_engine)
    status, d, model_dir = uninterrupted
    model = [] if "--preset" in argv else ["--model", str(model_dir)]
    metrics = tmp_path / "m.jsonl"
    assert main(["rl", *model, *SMALL, *argv, "--resume", str(d / "ckpt"), "--metrics", str(metrics)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert message in err and err.count("error:") == 1, err
    assert not metrics.exists()


@pytest.mark.slow
def test_quantized_run_saves_and_resumes(tmp_path):
    """A ModelOpt NVFP4 run (the trainer trains bf16 masters) saves its checkpoint and resumes from
    it: the resumed step equals the uninterrupted run's."""
    args = ["rl", "--preset", "nemotron_h_hybrid_tiny_nvfp4", "--num-prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "4", "--reward", "token-set", "--no-plot"]
    assert main([*args, "--steps", "2", "--metrics", str(tmp_path / "a.jsonl"), "--save", str(tmp_path / "ck"),
                 "--save-every", "1"]) == 0
    assert main([*args, "--steps", "2", "--metrics", str(tmp_path / "b.jsonl"),
                 "--resume", str(tmp_path / "ck" / "iter_0000001")]) == 0
    a, b = read_metrics(tmp_path / "a.jsonl"), read_metrics(tmp_path / "b.jsonl")
    assert [r["step"] for r in b] == [2] and _diff_zero(b[0])
    for k in ("rollout_sha256", "loss", "grad_norm"):
        assert a[1][k] == b[0][k], k
    # the result converts back: the trained bf16 masters (config without quantization_config) and,
    # with --requantize, the NVFP4 checkpoint under the recipe they were trained under
    from unified_models.converters.hf_safetensors import read_tensors, spec_and_state_dict
    from unified_models.converters.modelopt import master_spec
    from unified_models.presets import build_preset_checkpoint

    src = build_preset_checkpoint("nemotron_h_hybrid_tiny_nvfp4")
    _, spec, _ = spec_and_state_dict(src)
    step, state = _trained_state(tmp_path / "ck", master_spec(spec))
    assert step == 2
    last = str(tmp_path / "ck" / "iter_0000002")
    assert main(["convert", "--from", "megatron", "--to", "hf", last, str(tmp_path / "hf")]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    # the model's tokenizer came along; the recipe's hf_quant_config.json did not (it describes no master)
    assert not (tmp_path / "ck" / "iter_0000002" / "hf_assets" / "hf_quant_config.json").exists()
    assert not (tmp_path / "hf" / "hf_quant_config.json").exists()
    _assert_same_assets(tmp_path / "hf", src)
    back = read_tensors(tmp_path / "hf")
    assert len(back) > 60 and all(torch.equal(t, state[f"param.{n}"]) for n, t in back.items())
    _, plain, _ = spec_and_state_dict(tmp_path / "hf")
    assert not plain.stores_quantized_weights
    assert main(["convert", "--from", "megatron", "--to", "hf", "--requantize", last, str(tmp_path / "q")]) == 0
    assert (tmp_path / "q" / "config.json").read_text() == (src / "config.json").read_text()
    assert (tmp_path / "q" / "hf_quant_config.json").read_bytes() == (src / "hf_quant_config.json").read_bytes()
    _assert_same_assets(tmp_path / "q", src)
    _, qspec, _ = spec_and_state_dict(tmp_path / "q")
    assert qspec == spec


@pytest.mark.slow
def test_first_diff_stops_the_run_naming_step_sequence_and_position(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """Without the weight sync, vLLM samples step 2 with the old weights while the trainer
    has the new ones: the run must stop at step 2 (exit 1) and name where."""
    from unified_models.backends.vllm.weight_sync import SyncReport
    from unified_models.rl.run import RLRun

    monkeypatch.setattr(RLRun, "sync", lambda self: SyncReport((), (), (), 0, False, 0.0))
    metrics = tmp_path / "m.jsonl"
    status = main(["rl", "--model", str(tiny_checkpoint), *SMALL, "--steps", "3", "--metrics", str(metrics)])
    assert status == 1
    err = capsys.readouterr().err
    assert "diff != 0 at step 2, sequence 0" in err.replace("\n", " ") or "diff != 0 at step 2, sequence" in err
    assert "position" in err and "completion token" in err
    rows = read_metrics(metrics)
    assert [r["step"] for r in rows] == [1, 2]
    assert _diff_zero(rows[0]) and rows[1]["max_abs_diff"] > 0 and rows[1]["num_mismatched"] > 0
    assert (tmp_path / "m.png").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], None),
    (["--group-size", "1"], None),
    (["--lr", "-1"], None),
    (["--target-token-id", "x"], None),
    (["--reward", "bleu"], None),
    (["--save-every", "2"], "--save-every needs --save"),
    (["--reward", "gsm8k", "--target-token-id", "5"], "applies to --reward target-token"),
    (["--preset", "nemotron_h_tiny", "--model", "x"], "mutually exclusive"),
    (["--num-prompts-per-step", "500"], "exceeds the 200 prompts"),
    (["--target-token-id", "99999999"], "outside the model vocabulary"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must be in (0, 1]"),
])
def test_bad_flags_fail_cleanly(argv, message, tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    if message is None:
        with pytest.raises(SystemExit) as e:
            main(["rl", *argv, "--metrics", str(metrics)])
        assert e.value.code == 2
    else:
        assert main(["rl", *argv, "--metrics", str(metrics)]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("error:") == 1
    assert not metrics.exists()  # nothing half-written


def test_a_tokenizer_without_tokenizer_files_is_refused_before_anything_is_written(tmp_path, capsys):
    """`--tokenizer` naming a directory without tokenizer files fails (exit 2) naming it, before an engine
    starts: no metrics file, no checkpoint directory."""
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "config.json").write_text("{}")
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    assert main(["rl", "--tokenizer", str(tmp_path / "tok"), "--save", str(ck), "--metrics", str(metrics)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"tokenizer directory {tmp_path / 'tok'} holds none of ('tokenizer.json'" in err, err
    assert err.count("error:") == 1 and not ck.exists() and not metrics.exists()


def test_gsm8k_needs_answers_and_resume_needs_a_checkpoint(tmp_path, capsys):
    p = tmp_path / "q.jsonl"
    p.write_text(json.dumps({"question": "1 + 1?"}) + "\n")
    assert main(["rl", "--reward", "gsm8k", "--prompts", str(p), "--num-prompts-per-step", "1",
                 "--metrics", str(tmp_path / "m.jsonl")]) == 2
    assert "no 'answer' field" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["rl", "--resume", str(tmp_path / "empty"), "--metrics", str(tmp_path / "m.jsonl")]) == 2
    assert "no training checkpoint" in capsys.readouterr().err


def test_resume_with_a_broken_metrics_file_is_refused_before_any_engine(tmp_path, capsys):
    """A run killed while writing its metrics line leaves a broken last line; ``--resume`` keeps the
    file's earlier steps, so it is read (and refused, naming the line) before anything starts."""
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "latest_checkpointed_iteration.txt").write_text("1")
    metrics = tmp_path / "m.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2, "trunc')
    assert main(["rl", "--preset", "nemotron_h_tiny", "--resume", str(ck), "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert f"--metrics {metrics}:2: not JSON" in err and err.count("error:") == 1
    assert metrics.read_text() == '{"step": 1}\n{"step": 2, "trunc'  # untouched
    for bad, shown in (('{"step": null}', "None"), ('{"step": "2"}', "'2'"), ('{"reward_mean": 1.0}', "None"),
                       ('{"step": 1.0}', "1.0")):  # lines rl never writes: named, not a TypeError later
        metrics.write_text('{"step": 1}\n' + bad + "\n")
        assert main(["rl", "--preset", "nemotron_h_tiny", "--resume", str(ck), "--metrics", str(metrics)]) == 2
        err = capsys.readouterr().err
        assert f"--metrics {metrics}:2: step {shown} is not an integer" in err and err.count("error:") == 1, err
        assert metrics.read_text() == '{"step": 1}\n' + bad + "\n"


def test_metrics_writer_resume_refuses_lines_without_an_integer_step(tmp_path):
    """The writer a resumed run opens (what an API user calls directly) names the line and leaves the
    file as it was; a file of rl's own lines keeps steps <= k and drops later ones."""
    from unified_models.rl.metrics import MetricsWriter

    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": null}\n')
    with pytest.raises(ValueError, match=r"m\.jsonl:2: step None is not an integer"):
        MetricsWriter(path, resume_step=1)
    assert path.read_text() == '{"step": 1}\n{"step": null}\n'
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    MetricsWriter(path, resume_step=2)
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


@pytest.mark.parametrize("k, lines, restored", [
    (5, (3, 4), True), (5, (1, 2, 3, 4), True), (1, (), True), (2, (1,), True),  # steps m..k-1 (none at k = 1)
    (5, (3,), False), (5, (3, 5), False), (5, (), False), (5, (4, 5), False), (5, (4, 3), False),
    (5, (3, 4, 4), False), (1, (0,), False), (5, (0, 1, 2, 3, 4), False), (5, (-10 ** 29, 4), False)])
def test_metrics_writer_restores_the_saved_line_after_any_contiguous_start(tmp_path, k, lines, restored):
    """The checkpoint's line of step k is restored when the file holds steps m..k-1 in order (m >= 1; a
    file begun by an earlier resume starts at m > 1; none at k = 1, a run killed between its first
    checkpoint and its line), not after a gap, a repeat, steps < 1 or an empty file at k > 1; a saved
    line whose step is not the integer k is never written."""
    from unified_models.rl.metrics import MetricsWriter

    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in lines))
    w = MetricsWriter(path, resume_step=k, saved_row={"step": k, "reward_mean": 0.5})
    rows = read_metrics(path)
    assert (w.restored_step == k) is restored and (rows[-1:] == [{"step": k, "reward_mean": 0.5,
                                                                   "restored_from_checkpoint": True}]) is restored
    assert [r["step"] for r in rows] == [s for s in lines if s <= k] + ([k] if restored else [])
    for odd in (True, float(k)) if k == 1 else (float(k),):
        path.write_text("".join(json.dumps({"step": s}) + "\n" for s in lines))
        assert MetricsWriter(path, resume_step=k, saved_row={"step": odd}).restored_step is None


def test_resume_record_refuses_another_kl_reference_and_another_runs_metrics(tmp_path, monkeypatch):
    """``--resume`` checks the checkpoint's ``rl`` record before any engine: with ``--kl-coef > 0`` the
    initial weights (the KL reference, built from ``--model`` again) must be the saved run's; an existing
    ``--metrics`` file's line of the checkpoint's step must be the one the checkpoint recorded (its
    ``seconds`` may differ: the file's include the save). Records without them are not compared."""
    from types import SimpleNamespace

    from unified_models.backends.megatron import checkpoint
    from unified_models.dsl import UnifiedModelsError
    from unified_models.rl import startup

    row = {"step": 2, "reward_mean": 0.5, "rollout_sha256": "r2", "seconds": {"rollout": 1.0, "save": 0.0}}
    record = {"rl": {"initial_weights_sha256": "a" * 64, "metrics_row": row}}
    monkeypatch.setattr(checkpoint, "training_checkpoint_extra", lambda path, spec, **k: record)
    spec = SimpleNamespace(stores_quantized_weights=False)
    metrics = tmp_path / "m.jsonl"
    opts = SimpleNamespace(resume=str(tmp_path), model="/models/step2", preset=None, metrics=str(metrics))
    startup.check_resume_record(opts, spec, 2, "a" * 64)  # the same initial weights, no metrics file yet
    startup.check_resume_record(opts, spec, 2, None)  # no KL term now: not compared
    with pytest.raises(UnifiedModelsError, match=r"KL reference .*--model /models/step2 holds other weights"):
        startup.check_resume_record(opts, spec, 2, "b" * 64)
    line1 = {"step": 1, "reward_mean": 0.25, "rollout_sha256": "r1", "seconds": {}}
    metrics.write_text(json.dumps(line1) + "\n" + json.dumps(dict(row, seconds={"rollout": 1.0, "save": 3.0})) + "\n")
    startup.check_resume_record(opts, spec, 2, "a" * 64)  # the saved run's own file
    metrics.write_text(json.dumps(line1) + "\n" + json.dumps(dict(row, rollout_sha256="other")) + "\n")
    with pytest.raises(UnifiedModelsError, match=r"its line of step 2 is not the one the resumed checkpoint "
                                                 r"recorded \(differing: rollout_sha256\)"):
        startup.check_resume_record(opts, spec, 2, None)
    record["rl"] = {}  # an older checkpoint: nothing to compare
    startup.check_resume_record(opts, spec, 2, "b" * 64)
    # the digest follows every tensor's bytes, name and dtype
    sd = {"w": torch.zeros(3), "b": torch.ones(2)}
    base = startup.weights_sha256(sd)
    assert startup.weights_sha256(dict(sd, w=torch.tensor([0.0, 0.0, 1e-30]))) != base
    assert startup.weights_sha256({"v": sd["w"], "b": sd["b"]}) != base
    assert startup.weights_sha256(dict(sd, w=sd["w"].double())) != base
    assert startup.weights_sha256(dict(reversed(list(sd.items())))) == base
