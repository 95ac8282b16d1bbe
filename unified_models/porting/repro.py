"""A found divergence as a reproduction that fails on its own.

``write_repro`` writes into a directory:

* ``config.json``: the checkpoint's config (the spec is rebuilt from it);
* ``inputs.safetensors``: the op's inputs and the weights it reads:
  - kind ``mixer`` (the op is a sublayer's mixer or an op inside it): ``x`` = the
    sublayer's normed input ``[P+1, D]`` of the differing sequence, positions 0..P
    (stateful mixers need the whole prefix), and the mixer's parameters;
  - kind ``model`` (embedding, norms, residual adds, final norm, logits, logprobs):
    ``input_ids`` ``[P+1]`` and every parameter;
* ``outputs.safetensors``: each side's recorded row of the op at position P
  (``side_a`` / ``side_b``);
* ``meta.json``: op name, kind, sides, position, mode;
* ``repro.py``: recomputes the op from the inputs with unified_models' own forward
  (:func:`recompute`) and exits 1 when a side's recorded row differs from the
  recomputation (bitwise for ``--against trainer``; for ``--against reference`` the
  mixer is recomputed both by the engine ops and by its oracle and compared within
  the tolerance).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

import torch
from safetensors.torch import load_file

from ..converters.safetensors_io import save_safetensors
from .compare import Divergence
from .taps import TapRecorder, TapRecords, recording, tap_name

__all__ = ["write_repro", "recompute", "recompute_oracle", "SCRIPT"]

SCRIPT = '''"""Reproduction written by `unified-models bisect --against {mode}`.

{name} (layer {layer}, op {op}) differs between {side_a} and {side_b} at sequence {sequence},
position {position} (token {token}), element {element}: {value_a!r} vs {value_b!r}.
inputs.safetensors holds the op's inputs ({kind}: {what}); outputs.safetensors each side's row.
This recomputes the op with unified_models' own code and exits 1 when a side differs.
Run: python repro.py
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from unified_models.porting.compare import bits
from unified_models.porting.repro import recompute, recompute_oracle

here = Path(__file__).resolve().parent
meta = json.loads((here / "meta.json").read_text())
rows = load_file(str(here / "outputs.safetensors"))
got = recompute(here)
bad = []
if meta["tolerance"] is None:  # bitwise: every side must give the recomputed bits
    for side, key in ((meta["sides"][0], "side_a"), (meta["sides"][1], "side_b")):
        if rows[key].shape != got.shape or not torch.equal(bits(rows[key]), bits(got)):
            bad.append(side)
            print(f"{{side}}: differs from the recomputation, max |d| "
                  f"{{float((rows[key].double() - got.double()).abs().max()):.6g}}")
else:  # the engine op recomputed vs its oracle recomputed, within the relative tolerance
    want = recompute_oracle(here)
    d = float((got.double() - want.double()).abs().max())
    bound = meta["tolerance"] * float(want.double().abs().max())
    if not d <= bound:
        bad.append(meta["sides"][0])
        print(f"{{meta['sides'][0]}} vs {{meta['sides'][1]}}: max |d| {{d:.6g}} > bound {{bound:.6g}}")
print(f"{{meta['name']}}: " + ("REPRODUCED (" + ", ".join(bad) + ")" if bad else "not reproduced"))
sys.exit(1 if bad else 0)
'''


def _sublayer_of(spec, name: str):
    """The sublayer whose mixer is ``name`` or holds the op ``name`` (None for model-level taps)."""
    for sub in spec.sublayers:
        m = tap_name(sub.mixer.name)
        if name == m or (name.startswith(m + ".") and name != m + ".residual"):
            return sub
    return None


def _seq_prefix(records: TapRecords, name: str, seq: int, position: int) -> torch.Tensor:
    rows = records.rows(name)
    missing = [p for p in range(position + 1) if (seq, p) not in rows]
    if missing:
        raise RuntimeError(f"repro: {name} has no recorded row for sequence {seq} positions {missing[:5]}")
    return torch.stack([rows[(seq, p)] for p in range(position + 1)])


def write_repro(out_dir: Path, spec, model_dir: Path, state_dict: Mapping[str, torch.Tensor], div: Divergence,
                a: TapRecords, b: TapRecords, sequences: list[list[int]], *, mode: str) -> Path:
    """Write the reproduction of ``div`` into ``out_dir`` (replaced); returns ``out_dir / "repro.py"``.

    Args:
        spec, model_dir, state_dict: the model as both sides ran it.
        div: the divergence (:func:`~.compare.first_divergence`).
        a, b: the two sides' recordings.
        sequences: the token ids of each sequence.
        mode: ``trainer`` (bitwise), ``reference`` or ``peer`` (``div.tolerance``).
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    shutil.copy(Path(model_dir) / "config.json", out_dir / "config.json")
    s, p = div.sequence, div.position
    sub = _sublayer_of(spec, div.name)
    rows_a, rows_b = a.rows(div.name), b.rows(div.name)
    save_safetensors({"side_a": rows_a[(s, p)].contiguous(), "side_b": rows_b[(s, p)].contiguous()},
                     out_dir / "outputs.safetensors")
    if sub is not None:
        kind, what = "mixer", f"x = normed input of {tap_name(sub.mixer.name)} at positions 0..{p}, its parameters"
        tensors = {"x": _seq_prefix(a, tap_name(sub.norm.name), s, p).contiguous()}
        tensors.update({f"param.{n}": t.detach().cpu().contiguous() for n, t in state_dict.items()
                        if n.startswith(sub.mixer.name + ".")})
    else:
        kind, what = "model", f"input_ids of positions 0..{p}, every parameter"
        tensors = {"input_ids": torch.tensor(sequences[s][:p + 1], dtype=torch.long)}
        tensors.update({f"param.{n}": t.detach().cpu().contiguous() for n, t in state_dict.items()})
    save_safetensors(tensors, out_dir / "inputs.safetensors")
    meta = {"name": div.name, "kind": kind, "mode": mode, "sides": list(div.sides), "sequence": s, "position": p,
            "element": list(div.element), "tolerance": div.tolerance if mode == "reference" else None,
            "sublayer": None if sub is None else sub.index, "mixer": None if sub is None else sub.mixer.name}
    if mode == "peer":  # a tolerance against transformers: the script checks our op against the saved peer row
        meta["tolerance"] = None
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2))
    script = SCRIPT.format(mode=mode, name=div.name, layer=div.layer, op=div.op, side_a=div.sides[0],
                           side_b=div.sides[1], sequence=s, position=p, token=div.token_id,
                           element=list(div.element), value_a=div.value_a, value_b=div.value_b, kind=kind, what=what)
    path = out_dir / "repro.py"
    path.write_text(script)
    return path


def _saved_sublayer(spec, meta: dict):
    """The sublayer a ``mixer`` reproduction recomputes: by its mixer's name (a block's sublayers share
    its layer ``index``: Qwen3's attention and MLP), else (an older ``meta.json``) by index."""
    if meta.get("mixer") is not None:
        return next(s for s in spec.sublayers if s.mixer.name == meta["mixer"])
    return next(s for s in spec.sublayers if s.index == meta["sublayer"])


def _load(here: Path):
    from ..converters.hf_safetensors import load_hf_config
    from ..models import spec_from_hf_config

    meta = json.loads((here / "meta.json").read_text())
    spec = spec_from_hf_config(load_hf_config(here))
    t = load_file(str(here / "inputs.safetensors"))
    params = {k.removeprefix("param."): v for k, v in t.items() if k.startswith("param.")}
    return meta, spec, t, params


def recompute(here: Path) -> torch.Tensor:
    """The op's row at the saved position, recomputed from ``inputs.safetensors`` with the
    forward program (taps on for that op only): one sequence from position 0, packed alone."""
    from ..forward import forward_hidden, forward_logprobs
    from ..layers import LayerContext, family_of
    from ..private_state import PrivateStateStore
    from ..state import FlatBatch

    meta, spec, t, params = _load(Path(here))
    name, p = meta["name"], meta["position"]
    rec = TapRecorder(names={name})
    n = p + 1
    if meta["kind"] == "mixer":
        sub = _saved_sublayer(spec, meta)
        x = t["x"]
        batch = FlatBatch.from_cu_seqlens(torch.zeros(n, dtype=torch.long), torch.tensor([0, n]))
        store = PrivateStateStore(spec, [n], block_size=16)
        store.bind(batch)
        with torch.no_grad(), recording(rec):
            rec.begin(batch)
            y = family_of(sub.mixer, sub.index).forward(sub.mixer, sub.index, params, x, batch, store,
                                                        LayerContext(model=spec))
            if name == tap_name(sub.mixer.name):
                rec(sub.mixer.name, y)
    else:
        ids = t["input_ids"]
        batch = FlatBatch.from_cu_seqlens(ids, torch.tensor([0, n]))
        store = PrivateStateStore(spec, [n], block_size=16)
        store.bind(batch)
        with torch.no_grad(), recording(rec):
            forward_logprobs(spec, params, forward_hidden(spec, params, batch, store))
    rows = rec.records.rows(name)
    if (0, p) not in rows:
        raise RuntimeError(f"repro: the recomputation never computed {name} at position {p}")
    return rows[(0, p)]


def recompute_oracle(here: Path) -> torch.Tensor:
    """The mixer's oracle (fp64) on the saved input, row at the saved position (``--against reference``)."""
    from ..layers import family_of

    meta, spec, t, params = _load(Path(here))
    if meta["kind"] != "mixer":
        raise RuntimeError("repro: the oracle recomputation covers mixers; this op is model-level")
    sub = _saved_sublayer(spec, meta)
    p64 = {k: v.double() if v.is_floating_point() else v for k, v in params.items()}
    with torch.no_grad():
        y = family_of(sub.mixer, sub.index).oracle(sub.mixer, p64, t["x"].double())
    return y[meta["position"]]
