"""Per-step host costs of an RL step (issue 16 item 7), before and after, in one run (CPU or GPU).

Measures, on one preset's checkpoint (default ``nemotron_h_wide``):

* **sync**: one in-place weight sync of the full state dict into the vLLM engine
  (``RolloutEngine.sync_weights``), every tensor changed (two state dicts alternate);
* **sync_unchanged**: the same sync when nothing changed (validation + comparison only);
* **params**: one ``params()`` call of the vLLM model (what each forward reads; the
  ``forward_params()`` of the new code where it exists);
* **recompute**: one ``Trainer.logprobs`` of a fixed packed batch (random tokens,
  several THD micro-batches).

Each is the median of ``--repeats`` timed runs after one untimed warm-up. The recompute's
logprob bits are hashed, so the run also shows that both trees compute the same values.

``--baseline-tree DIR`` runs the same measurement with ``PYTHONPATH=DIR`` (another
checkout, e.g. a worktree of the commit before) in a subprocess first, and reports the
ratio after / before of every median. Each tree runs in its own subprocess, one after
the other, so neither shares memory or threads with the other.

    python benchmarks/step_costs.py --baseline-tree /work/before
    python benchmarks/step_costs.py --device cuda --baseline-tree DIR   # -> results/step_costs_h200.json

On a GPU every timed run ends with ``torch.cuda.synchronize()``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
DEFAULT_JSON = {"cpu": HERE.parent / "results" / "step_costs_cpu.json",
                "cuda": HERE.parent / "results" / "step_costs_h200.json"}


def _median_s(fn, repeats: int) -> tuple[float, list[float]]:
    import torch

    def run():
        fn()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()

    run()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _get_model(llm):
    try:  # after the split: backends/vllm/live.py
        from unified_models.backends.vllm.live import get_model
    except ImportError:  # before: backends/vllm/engine.py
        from unified_models.backends.vllm.engine import get_model
    return get_model(llm)


def worker(args) -> dict:
    """The measurement in this process (whatever ``unified_models`` the path resolves to)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import random

    import torch

    import unified_models
    from unified_models.backends.megatron.trainer import Trainer, TrainerOptions
    from unified_models.backends.vllm.rollout import RolloutEngine
    from unified_models.converters.hf_safetensors import spec_and_state_dict
    from unified_models.presets import build_preset_checkpoint

    out: dict = {"unified_models": str(Path(unified_models.__file__).parent), "torch_threads": torch.get_num_threads()}
    model_dir = build_preset_checkpoint(args.preset)
    _, spec, sd = spec_and_state_dict(model_dir)
    out["parameters"] = sum(t.numel() for t in sd.values())
    out["bytes"] = sum(t.numel() * t.element_size() for t in sd.values())
    # a second state dict in which every tensor differs (bf16 + 1/64, rounded)
    other = {n: (t.float() + 1.0 / 64).to(t.dtype) for n, t in sd.items()}
    rng = random.Random(0)
    lens = [(args.prompt_len, args.completion_len)] * args.seqs
    prompts = [[rng.randrange(spec.vocab_size) for _ in range(p)] for p, _ in lens]
    completions = [[rng.randrange(spec.vocab_size) for _ in range(c)] for _, c in lens]

    t0 = time.perf_counter()
    out["device"] = args.device
    if args.device == "cuda":
        out["gpu"] = torch.cuda.get_device_name(0)
    with RolloutEngine(spec, model_dir, state_dict=sd, device=args.device, seed=0,
                       max_model_len=args.prompt_len + args.completion_len, max_num_seqs=2) as engine:
        out["engine_start_s"] = time.perf_counter() - t0
        model = _get_model(engine.llm)
        flip = [True]

        def sync_changed():
            report = engine.sync_weights(other if flip[0] else sd)
            flip[0] = not flip[0]
            assert len(report.copied) == len(sd), (len(report.copied), len(sd))

        out["sync_s"], out["sync_runs_s"] = _median_s(sync_changed, args.repeats)
        engine.sync_weights(sd)
        out["sync_unchanged_s"], out["sync_unchanged_runs_s"] = _median_s(
            lambda: engine.sync_weights(sd), args.repeats)
        live = {n: p.detach().cpu() for n, p in model.params().items()}
        assert all(torch.equal(live[n], sd[n]) for n in sd), "the engine does not hold the checkpoint after the syncs"
        per_forward = getattr(model, "forward_params", model.params)
        n_calls = 200
        out["params_s"] = _median_s(lambda: [per_forward() for _ in range(n_calls)], args.repeats)[0] / n_calls
    with Trainer(spec, sd, device=args.device, options=TrainerOptions(micro_batch_tokens=args.micro_batch_tokens)) as trainer:
        res = []

        def recompute():
            res.append(trainer.logprobs(prompts, completions))

        out["recompute_s"], out["recompute_runs_s"] = _median_s(recompute, args.repeats)
        bits = [torch.cat(r.logprobs).cpu().view(torch.int32) for r in res]
        assert all(torch.equal(b, bits[0]) for b in bits), "recompute is not deterministic"
        out["recompute_sha256"] = hashlib.sha256(bits[0].numpy().tobytes()).hexdigest()
        out["micro_batches"] = len(trainer.pack(prompts, completions))
    return out


def _run_tree(tree: Path | None, args, tag: str) -> dict:
    env = dict(os.environ)
    if tree is not None:
        tree = tree.resolve()  # the worker runs with cwd=tree: a relative PYTHONPATH would miss it
        env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out_file = Path(f"/tmp/step_costs_{tag}_{os.getpid()}.json")
    cmd = [sys.executable, str(HERE), "--worker", str(out_file), "--preset", args.preset, "--repeats",
           str(args.repeats), "--seqs", str(args.seqs), "--prompt-len", str(args.prompt_len), "--completion-len",
           str(args.completion_len), "--micro-batch-tokens", str(args.micro_batch_tokens), "--device", args.device]
    print(f"[{tag}] {' '.join(cmd)}" + (f" (PYTHONPATH={tree})" if tree else ""), file=sys.stderr, flush=True)
    subprocess.run(cmd, env=env, check=True, cwd=str(tree) if tree is not None else None)
    result = json.loads(out_file.read_text())
    out_file.unlink()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from unified_models.presets import preset_name
    ap.add_argument("--preset", type=preset_name, default="nemotron_h_wide")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                    help="auto: cuda when a GPU is visible")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another checkout measured first with PYTHONPATH set to it (e.g. /work/before)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=4, help="sequences of the recompute batch")
    ap.add_argument("--prompt-len", type=int, default=12)
    ap.add_argument("--completion-len", type=int, default=4)
    ap.add_argument("--micro-batch-tokens", type=int, default=32, help="THD micro-batch size of the recompute")
    ap.add_argument("--json", dest="json_out", type=Path, default=None,
                    help="default: results/step_costs_cpu.json or results/step_costs_h200.json by device")
    ap.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device == "auto":
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.json_out is None:
        args.json_out = DEFAULT_JSON[args.device]
    if args.repeats < 1 or args.seqs < 1 or args.prompt_len < 1 or args.completion_len < 1:
        ap.error("--repeats, --seqs, --prompt-len and --completion-len must be >= 1")
    if args.worker is not None:
        args.worker.write_text(json.dumps(worker(args)))
        return 0
    if args.baseline_tree is not None and not (args.baseline_tree / "unified_models" / "__init__.py").is_file():
        ap.error(f"--baseline-tree {args.baseline_tree} has no unified_models package")
    report: dict = {"preset": args.preset, "repeats": args.repeats,
                    "recompute_batch": {"seqs": args.seqs, "prompt_len": args.prompt_len,
                                        "completion_len": args.completion_len,
                                        "micro_batch_tokens": args.micro_batch_tokens},
                    "cpu_count": os.cpu_count(), "load_avg_start": os.getloadavg()}
    if args.baseline_tree is not None:
        report["before"] = _run_tree(args.baseline_tree, args, "before")
    report["after"] = _run_tree(None, args, "after")
    report["load_avg_end"] = os.getloadavg()
    keys = ("sync_s", "sync_unchanged_s", "params_s", "recompute_s")
    if "before" in report:
        report["ratio_after_over_before"] = {k: report["after"][k] / report["before"][k] for k in keys}
        report["same_recompute_bits"] = report["after"]["recompute_sha256"] == report["before"]["recompute_sha256"]
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps(report, indent=2))
    for k in keys:
        line = f"{k:18s} after {report['after'][k]:.6f} s"
        if "before" in report:
            line += f"  before {report['before'][k]:.6f} s  ratio {report['ratio_after_over_before'][k]:.3f}"
        print(line)
    if "before" in report:
        print(f"recompute logprob bits equal before/after: {report['same_recompute_bits']}")
    return 0 if report.get("same_recompute_bits", True) else 1


if __name__ == "__main__":
    sys.exit(main())
