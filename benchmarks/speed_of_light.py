"""HBM-bound speed of light of a decode step, beside the measured tokens/s of a rollout benchmark run.

For each workload of a ``benchmarks/rollout_throughput.py`` result file (default: the run of record,
``benchmarks/results/rollout_throughput.json``), a decode step of ``B`` running sequences at mean
context ``L`` must read at least (issue 18 item 6):

* every weight the step touches once: all dense tensors (the LM head in full, the embedding's ``B``
  rows) and, per MoE layer, the routed experts some token of the step is routed to: the expected
  number of distinct experts under uniform routing, ``E (1 - (1 - k/E)^B)``, of the layer's ``E``;
* the KV cache of every attention layer: ``2 L n_kv head_dim`` elements per sequence;
* the Mamba-2 state of every Mamba layer, read and written: the SSM state (``heads x head_dim x
  d_state``, in ``mamba_ssm_cache_dtype``) and the conv state (``(conv_kernel - 1) x conv_dim``).

A quantized preset (one with ``quantize:`` in ``unified_models/configs/<name>.yaml``, e.g.
``nemotron_3_nano_reduced_nvfp4``) counts its base preset's tensors in the stored formats of ModelOpt's
export: an NVFP4 weight 0.5 + 1/16 bytes per element (two e2m1 values per byte, one e4m3 scale per 16
elements), an FP8 weight 1 byte, an FP8 KV cache 1 byte per element; per-tensor fp32 scales are not
counted.

The bound is ``B / (bytes / HBM bandwidth)`` tokens/s (4.8 TB/s: the H200's HBM3e). ``B`` =
``min(requests, max_num_seqs)`` of the run, ``L`` = prompt + half the completion. The measured
figures are whole-workload output tokens/s (prefill, scheduling and sampling included), so
``ours / SoL`` is an upper bound on the decode kernels' share of the bandwidth, not a kernel
efficiency. Activations, logits and the sampled rows are not counted (a few MB per step).

    python benchmarks/speed_of_light.py [--results FILE] [--hbm-tb-s 4.8] [--json OUT]

Raises SystemExit with a message for a results file without the fields it needs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
DEFAULT_RESULTS = ROOT / "results" / "rollout_throughput.json"
DEFAULT_JSON = ROOT / "results" / "speed_of_light.json"


# stored bytes per weight element of a quantized linear (ModelOpt's export layout)
FORMAT_BYTES = {"nvfp4": 0.5 + 1.0 / 16, "fp8": 1.0}


def _spec_of_preset(name: str):
    """The preset's :class:`~unified_models.dsl.ModelSpec` from its config alone (no weights built); a
    quantized preset gives its base preset's (the formats: :func:`quantization_of_preset`)."""
    from transformers import AutoConfig

    from unified_models.models import spec_from_hf_config
    from unified_models.presets import load_preset

    preset = load_preset(name)
    if "quantize" in preset:
        return _spec_of_preset(preset["quantize"]["base"])
    config = AutoConfig.for_model(preset["family"], **preset["hf_config"])
    return spec_from_hf_config(config, dtype=getattr(torch, preset.get("dtype", "bfloat16"))), config


def quantization_of_preset(name: str) -> dict[str, str]:
    """Export role (``experts``, ``mamba_proj``, ``kv_cache``) -> stored format (``nvfp4``, ``fp8``) of a
    quantized preset; ``{}`` for a preset in the model dtype.

    Raises:
        SystemExit: a format this count does not know (not in :data:`FORMAT_BYTES`).
    """
    from unified_models.presets import load_preset

    q = load_preset(name).get("quantize") or {}
    formats = {role: fmt for role, fmt in q.items() if role not in ("base", "calibration_prompts") and fmt}
    unknown = {r: f for r, f in formats.items() if f not in FORMAT_BYTES}
    if unknown:
        raise SystemExit(f"{name}: formats {unknown} have no byte count (known: {sorted(FORMAT_BYTES)})")
    return formats


def step_bytes(spec, config, batch: int, context: int, kv_bytes: float = 2,
               formats: dict[str, str] | None = None) -> dict[str, float]:
    """Bytes one decode step of ``batch`` sequences at ``context`` tokens must read (and, for the
    Mamba state, write), by part: ``dense``, ``experts``, ``kv``, ``mamba_state``, ``total``.

    Args:
        spec: the model (its stored parameter shapes and dtypes).
        config: its HF config (attention and Mamba-2 widths: ``num_key_value_heads``, ``head_dim``,
            ``mamba_num_heads``, ``mamba_head_dim``, ``ssm_state_size``, ``n_groups``, ``expand``,
            ``conv_kernel``, ``hidden_size``, ``mamba_ssm_cache_dtype``, ``hybrid_override_pattern``).
        batch, context: B sequences, L tokens of context each.
        kv_bytes: bytes per KV element (2: bf16; 1: FP8).
        formats: export role -> stored format of the quantized linears (:func:`quantization_of_preset`;
            ``kv_cache`` is ignored here: pass ``kv_bytes``); a linear's ``.weight`` then counts
            :data:`FORMAT_BYTES` per element instead of the model dtype.
    """
    from unified_models.layers.expert_shards import expert_groups
    from unified_models.layers.quantization import quantizable_linears

    shapes, dtypes = spec.parameter_shapes(), spec.parameter_dtypes()
    stored = {f"{linear}.weight": FORMAT_BYTES[formats[role]]
              for linear, role in quantizable_linears(spec).items() if role in (formats or {})}

    def nbytes(name: str) -> float:
        per = stored.get(name, torch.empty(0, dtype=dtypes[name]).element_size())
        return torch.Size(shapes[name]).numel() * per

    expert_names: set[str] = set()
    experts = 0.0
    for _, linears in expert_groups(spec):
        e = len(linears)
        k = int(config.num_experts_per_tok)
        touched = e * (1.0 - (1.0 - k / e) ** batch) / e  # expected share of the layer's experts read
        for linear in linears:
            for name in shapes:
                if name.startswith(linear + "."):
                    expert_names.add(name)
                    experts += touched * nbytes(name)
    dense = 0.0
    for name in shapes:
        if name in expert_names:
            continue
        if "embed" in name:  # the step reads B rows of the input embedding
            dense += batch * shapes[name][-1] * torch.empty(0, dtype=dtypes[name]).element_size()
        else:
            dense += nbytes(name)
    pattern = str(getattr(config, "hybrid_override_pattern", ""))
    n_attn, n_mamba = pattern.count("*"), pattern.count("M")
    kv = n_attn * batch * 2 * context * config.num_key_value_heads * config.head_dim * kv_bytes
    ssm_elt = torch.empty(0, dtype=getattr(torch, str(getattr(config, "mamba_ssm_cache_dtype", "float32")))).element_size()
    ssm = config.mamba_num_heads * config.mamba_head_dim * config.ssm_state_size * ssm_elt
    conv_dim = config.expand * config.hidden_size + 2 * config.n_groups * config.ssm_state_size
    conv = (config.conv_kernel - 1) * conv_dim * torch.empty(0, dtype=spec.dtype).element_size()
    mamba = n_mamba * batch * 2 * (ssm + conv)  # read and written back
    return {"dense": dense, "experts": experts, "kv": kv, "mamba_state": mamba,
            "total": dense + experts + kv + mamba}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="rollout_throughput.py JSON")
    ap.add_argument("--hbm-tb-s", type=float, default=4.8, help="HBM bandwidth in TB/s (H200: 4.8)")
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"output (default {DEFAULT_JSON})")
    args = ap.parse_args(argv)
    try:
        run = json.loads(args.results.read_text())
        preset, workloads, settings = run["preset"], run["workloads"], run["settings"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{args.results}: not a rollout_throughput.py result with preset/workloads/settings ({e})")
    spec, config = _spec_of_preset(preset)
    formats = quantization_of_preset(preset)
    kv_bytes = 1 if formats.get("kv_cache") == "fp8" else 2
    rows = []
    for w in workloads:
        batch = min(int(w["num_requests"]), int(settings["max_num_seqs"]))
        context = int(w["input_len"]) + int(w["output_len"]) // 2
        b = step_bytes(spec, config, batch, context, kv_bytes=kv_bytes, formats=formats)
        sol = batch / (b["total"] / (args.hbm_tb_s * 1e12))
        ours, native = w.get("ours_tok_s"), w.get("native_tok_s")
        rows.append({"workload": w["name"], "batch": batch, "mean_context": context,
                     "bytes_per_step_gb": {k: round(v / 1e9, 4) for k, v in b.items()},
                     "sol_tok_s": round(sol, 1), "ours_tok_s": ours, "native_tok_s": native,
                     "ours_of_sol": None if ours is None else float(f"{ours / sol:.4g}"),
                     "native_of_sol": None if native is None else float(f"{native / sol:.4g}")})
    try:  # inside the repo: a relative path, so the committed file does not change with the checkout's place
        results_name = str(args.results.resolve().relative_to(ROOT.parent))
    except ValueError:
        results_name = str(args.results)
    out = {"results": results_name, "preset": preset, "device": run.get("device"), "hbm_tb_s": args.hbm_tb_s,
           "formats": formats, "kv_bytes": kv_bytes, "rows": rows}
    if args.json.is_dir():
        raise SystemExit(f"--json {args.json}: is a directory; give a file name")
    tmp = args.json.with_name(args.json.name + ".tmp")
    try:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(out, indent=1) + "\n")
        tmp.replace(args.json)  # whole or not at all
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise SystemExit(f"--json {args.json}: cannot write the result there ({e.strerror or e})")
    print(f"{preset} on {run.get('device')}, HBM {args.hbm_tb_s} TB/s; formats {formats or 'model dtype'}; "
          "bytes per decode step in GB")
    print("| workload | B | L | weights (dense + experts) | KV | Mamba state | SoL tok/s | ours | native | ours/SoL | native/SoL |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        g = r["bytes_per_step_gb"]
        print(f"| {r['workload']} | {r['batch']} | {r['mean_context']} | {g['dense']:.2f} + {g['experts']:.2f} | "
              f"{g['kv']:.2f} | {g['mamba_state']:.2f} | {r['sol_tok_s']:,.0f} | {r['ours_tok_s'] or 0:,.0f} | "
              f"{r['native_tok_s'] or 0:,.0f} | {r['ours_of_sol']} | {r['native_of_sol']} |")
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
