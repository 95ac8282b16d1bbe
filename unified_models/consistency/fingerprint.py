"""Fingerprints: the execution contract each engine runs, and the weights after a sync.

Two kinds, both cheap, both named so that a difference says *what* differs:

**Contract fingerprint** (:func:`contract_fingerprint` -> :class:`Fingerprint`). Each engine
builds its own from what it loaded (the vLLM side from the live model inside the engine,
``backends/vllm/fingerprint.py``; the Megatron side from the trainer's module,
``Trainer.contract_fingerprint``). Components (name -> canonical value, each hashed):

* ``kernel_path``: which implementation the ops dispatch to on this engine's device
  (``torch-cpu``, ``triton``, ``triton-interpreter``; ``ops/_dispatch.py``);
* ``kernel_source.<family>``: SHA-256 of every source file of op family ``<family>``
  (``ops/<family>/``; ``shared``: ``ops/*.py`` and ``ops/grad/``, ``ops/triton/`` on a Triton
  path) on the dispatched path: fp64 oracles (``*reference.py``) are never dispatched, the
  Triton kernels (``triton.py``, ``*_triton.py``) only on a Triton path, the CPU
  implementations (``cpu.py``, ``*_cpu.py``) only on the ``torch-cpu`` path;
* ``kernel_config.<family>``: the live values of the upper-case module-level constants of
  those same files (block sizes, ``num_warps``/``num_stages``, GEMM tiers, row tiles, ...;
  read from the imported modules, so a value set at import time from the environment, or
  patched, is what is hashed). Immutable values only (numbers, strings, dtypes, tuples,
  frozen dataclasses, ``tl.constexpr``); dicts and lists in ``ops/`` are runtime caches
  (``_NUM_SMS``, rope tables), not configs;
* ``source.forward``, ``source.quantization``: the forward program and the layer families
  (``forward.py``, ``state.py``, ``caches.py``, ``layers/``), and the quantization rules
  (``dsl/weights.py``, ``layers/weight_formats.py``, ``layers/quantization.py``);
* ``weight_formats``: the compute rule of every quantized linear (``LinearFormat.master()``:
  a stored checkpoint and the trainer's master of the same format run the same rule);
* ``dtypes``: the model dtype and the dtype of every parameter the engine holds outside
  the quantized linears (whose stored layout the format fixes);
* ``op_table``: per layer, the sublayer families (the spec's layer types) and the
  residual policy; ``spec``: every other field of the (master-form) spec, per block;
* ``device``: ``cpu`` or the CUDA device name and compute capability;
* ``library.torch``, ``library.triton`` (a Triton path only), ``library.numpy`` (the Triton
  interpreter only: its ``tl.dot`` sums go through numpy); ``numerics.torch_flags``: the
  process-wide torch switches that change matmul numerics (TF32, reduced-precision
  reductions, float32 matmul precision). Host BLAS and thread counts are *not* part of the
  contract: no CPU result depends on them (``docs/consistency.md``, "CPU results do not
  depend on the host's BLAS");
* engine-own components, prefixed by the engine: ``vllm.version``, ``vllm.settings``
  (model class, dtype, logprobs mode, Mamba cache dtype), ``vllm.source``
  (``backends/vllm/``); ``megatron.version``, ``megatron.source`` (``backends/megatron/``,
  ``private_state.py``).

:attr:`Fingerprint.digest` hashes the shared components (equal on both engines when their
contracts agree); :attr:`Fingerprint.engine_digest` hashes all of them. :func:`compare`
checks the shared components of two fingerprints (and the engine-own ones when both come
from the same engine) and raises :class:`FingerprintMismatchError` naming the first
differing component, the differing entry inside it and both values. ``check`` and ``rl``
refuse before any diff is computed; ``bisect`` and the server are meant to call the same
two functions.

**Weight fingerprint** (:func:`tensor_checksums`, :func:`verify_weight_sync`). After every
in-place weight sync, each tensor's checksum is computed on its own device on both sides
(the trainer's tensor, cast to the engine dtype; the engine's parameter after the copy) and
compared per tensor. The checksum of a tensor of n elements is over its raw bits ``x_i``
(the element viewed as an unsigned integer of its width: 8, 16, 32 or 64 bits)::

    c = sum_i x_i * (2 i + 1)   (mod 2**64)

computed in int64 (wrap-around arithmetic) in chunks of :data:`CHECKSUM_CHUNK` elements.
Integer addition mod 2**64 is associative and commutative, so the value does not depend
on the reduction order, the device or the chunking: the CPU and the GPU give the same
number. Because every weight ``2 i + 1`` is odd (invertible mod 2**64) and ``|x'_i - x_i| <
2**32`` for elements of up to 32 bits, *any* change of a single element (a single bit flip
included) changes ``c``; swapping two different elements ``i != j`` changes it by
``2 (i - j)(x_j - x_i)``, never 0 mod 2**64 for tensors of fewer than 2**31 elements.
Several changes at once can cancel only by an arithmetic coincidence mod 2**64. Cost:
a few elementwise int64 passes over the tensor (about 40 bytes of memory traffic per
element) and one host read per device per sync; measured on the CPU for the tiny preset in
``docs/consistency.md`` ("Fingerprints").
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import hashlib
import json
import os
import re
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch

from ..dsl import UnifiedModelsError

__all__ = ["Fingerprint", "FingerprintMismatchError", "WeightFingerprint", "WeightFingerprintError",
           "CHECKSUM_CHUNK", "compare", "contract_fingerprint", "kernel_path", "library_version",
           "tensor_checksum", "tensor_checksums", "verify_weight_sync"]

PACKAGE = Path(__file__).resolve().parent.parent
"""The ``unified_models`` package directory whose sources are hashed."""

ENGINES = ("vllm", "megatron")
"""Engine names; a component named ``<engine>.<...>`` belongs to that engine only."""


# ============================================================================ contract fingerprint

class FingerprintMismatchError(UnifiedModelsError):
    """Two engines' execution contracts differ; names the component, the entry and both values.

    Attributes:
        component: the first differing component (e.g. ``kernel_config.linear``).
        key: the differing entry inside it (e.g. ``triton.py:GPU_TIERS``), or None.
        values: ``(a's value, b's value)`` of that entry (or of the whole component).
    """

    def __init__(self, message: str, component: str, key: str | None, values: tuple[Any, Any]):
        super().__init__(message)
        self.component = component
        self.key = key
        self.values = values


def _canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


@dataclass(frozen=True)
class Fingerprint:
    """One engine's execution contract.

    Attributes:
        engine: ``"vllm"`` or ``"megatron"`` (or another engine's name).
        components: name -> canonical value (a string, or a dict of strings to strings); see
            the module docstring for the names.
    """

    engine: str
    components: Mapping[str, Any] = field(default_factory=dict)

    def component_digests(self) -> dict[str, str]:
        """Name -> SHA-256 (hex) of the component's canonical JSON."""
        return {k: _sha(_canonical_json(v)) for k, v in sorted(self.components.items())}

    def shared_names(self) -> list[str]:
        """The components every engine has (not prefixed by an engine name), sorted."""
        return sorted(k for k in self.components if k.split(".", 1)[0] not in ENGINES)

    @property
    def digest(self) -> str:
        """SHA-256 (hex) over the shared components' digests: equal for two engines that run one contract."""
        d = self.component_digests()
        return _sha("\n".join(f"{k}={d[k]}" for k in self.shared_names()))

    @property
    def engine_digest(self) -> str:
        """SHA-256 (hex) over every component, the engine-own ones included."""
        return _sha("\n".join(f"{k}={v}" for k, v in self.component_digests().items()))

    def with_component(self, name: str, value: Any) -> "Fingerprint":
        """A copy with one component replaced (for tests and tools)."""
        return Fingerprint(self.engine, {**self.components, name: value})

    def as_dict(self) -> dict:
        """JSON form: engine, both digests, every component's digest (first 16 hex digits) and the
        values of the short human-readable components (versions, device, path, flags)."""
        short = {k: v for k, v in self.components.items()
                 if isinstance(v, str) or (k.startswith(("library.", "numerics.", "vllm.settings")))}
        return {"engine": self.engine, "digest": self.digest, "engine_digest": self.engine_digest,
                "components": {k: v[:16] for k, v in self.component_digests().items()}, "values": short}


def _short(v: Any, limit: int = 300) -> str:
    s = v if isinstance(v, str) else _canonical_json(v)
    return s if len(s) <= limit else s[:limit] + f"... ({len(s)} chars)"


def compare(a: Fingerprint, b: Fingerprint) -> None:
    """Refuse two engines whose execution contracts differ.

    The shared components are compared (and the engine-own ones when ``a.engine ==
    b.engine``, e.g. two vLLM engines); the first difference in sorted component order
    raises.

    Raises:
        FingerprintMismatchError: names the component, the entry inside it (a file, a
            constant, a parameter, a layer) and both values.
    """
    names = sorted(set(a.components) | set(b.components)) if a.engine == b.engine else \
        sorted(set(a.shared_names()) | set(b.shared_names()))
    missing = "<absent>"
    for name in names:
        va, vb = a.components.get(name, missing), b.components.get(name, missing)
        if va == vb:
            continue
        key, xa, xb = None, va, vb
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            for k in sorted(set(va) | set(vb)):
                if va.get(k, missing) != vb.get(k, missing):
                    key, xa, xb = k, va.get(k, missing), vb.get(k, missing)
                    break
        where = f"{name!r}" + (f" entry {key!r}" if key is not None else "")
        raise FingerprintMismatchError(
            f"execution contracts differ ({a.engine} fingerprint {a.digest[:16]} vs {b.engine} "
            f"{b.digest[:16]}): component {where}: {a.engine} {_short(xa)} vs {b.engine} {_short(xb)}; "
            "refusing to compare the engines' outputs (both must run the same kernels, configs, "
            "quantization rules, spec and numerics libraries)", name, key, (xa, xb))


# ----------------------------------------------------------------------------- components

def library_version(module: str) -> str:
    """The version of the library ``module`` (``torch``, ``triton``, ``vllm``, ``megatron.core``,
    ``numpy``) this process runs: the imported module's ``__version__``, else the installed
    distribution's (without importing it), else ``"absent"``."""
    mod = sys.modules.get(module)
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    from importlib import metadata

    for dist in (module.replace(".", "-"), module.split(".")[0]):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "absent"


def kernel_path(device: torch.device | str) -> str:
    """Which implementation the ops dispatch to for tensors on ``device``
    (``ops._dispatch.use_triton``): ``"triton"``, ``"triton-interpreter"`` or ``"torch-cpu"``."""
    dev = torch.device(device)
    if dev.type == "cuda" or os.environ.get("UM_OPS_BACKEND", "torch") == "triton":
        from ..ops.triton._common import INTERPRET

        return "triton-interpreter" if INTERPRET else "triton"
    return "torch-cpu"


def _device_name(device: torch.device | str) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(idx)
        return f"cuda: {torch.cuda.get_device_name(idx)} (sm_{major}{minor})"
    return dev.type


def _on_path(rel: str, path: str) -> bool:
    name = rel.rsplit("/", 1)[-1]
    if not name.endswith(".py") or name.endswith("reference.py"):
        return False
    tritonish = name == "triton.py" or name.endswith("_triton.py") or rel.startswith("ops/triton/")
    cpuish = name == "cpu.py" or name.endswith("_cpu.py")
    if path == "torch-cpu":
        return not tritonish
    return not cpuish


def _family_files(path: str) -> dict[str, list[str]]:
    """Op family -> the package-relative source files on the dispatched ``path`` (sorted)."""
    ops = PACKAGE / "ops"
    out: dict[str, list[str]] = {}
    for f in sorted(ops.rglob("*.py")):
        rel = f.relative_to(PACKAGE).as_posix()
        if not _on_path(rel, path):
            continue
        parts = f.relative_to(ops).parts
        fam = parts[0] if len(parts) > 1 and parts[0] not in ("grad", "triton") else "shared"
        if len(parts) == 1 and parts[0] in ("nvfp4.py", "mxfp4.py"):
            fam = parts[0][:-3]
        out.setdefault(fam, []).append(rel)
    return out


def _sources(rels: Iterable[str]) -> dict[str, str]:
    return {rel: _sha((PACKAGE / rel).read_bytes()) for rel in rels}


def _module_name(rel: str) -> str:
    mod = "unified_models." + rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


_CONSTANT = re.compile(r"_?[A-Z][A-Z0-9_]*")


_NAMES_CACHE: dict[tuple[str, str], list[str]] = {}


def _top_level_names(rel: str) -> list[str]:
    """Upper-case names assigned at the top level of a source file (its constants); parsed
    once per file content."""
    text = (PACKAGE / rel).read_bytes()
    key = (rel, _sha(text))
    if key not in _NAMES_CACHE:
        _NAMES_CACHE[key] = _parse_constant_names(text)
    return _NAMES_CACHE[key]


def _parse_constant_names(text: bytes) -> list[str]:
    tree = ast.parse(text)
    names: list[str] = []
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        for t in targets:
            for n in ast.walk(t):
                if isinstance(n, ast.Name) and _CONSTANT.fullmatch(n.id):
                    names.append(n.id)
    return sorted(set(names))


_SKIP = object()


def _canonical_value(v: Any) -> Any:
    """A JSON-able canonical form of an immutable config value, or ``_SKIP``."""
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        return float.hex(v)
    if isinstance(v, enum.Enum):
        return f"{type(v).__name__}.{v.name}"
    if isinstance(v, torch.dtype):
        return str(v)
    if isinstance(v, tuple) and hasattr(v, "_fields"):  # a NamedTuple (GemmConfig): keep the field names
        items = {f: _canonical_value(getattr(v, f)) for f in v._fields}
        return _SKIP if any(x is _SKIP for x in items.values()) else {type(v).__name__: items}
    if isinstance(v, (tuple, frozenset)):
        items = [_canonical_value(x) for x in (sorted(v, key=repr) if isinstance(v, frozenset) else v)]
        return _SKIP if any(x is _SKIP for x in items) else items
    if isinstance(v, types.MappingProxyType):
        items = {str(k): _canonical_value(x) for k, x in v.items()}
        return _SKIP if any(x is _SKIP for x in items.values()) else items
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        items = {f.name: _canonical_value(getattr(v, f.name)) for f in dataclasses.fields(v)}
        return _SKIP if any(x is _SKIP for x in items.values()) else {type(v).__name__: items}
    if type(v).__name__ == "constexpr" and hasattr(v, "value"):  # triton.language.constexpr
        return _canonical_value(v.value)
    return _SKIP  # dicts, lists (runtime caches), tensors, functions


def _configs(rels: Iterable[str]) -> dict[str, str]:
    """``file:NAME`` -> canonical JSON of the live value of each constant of ``rels``."""
    import importlib

    out: dict[str, str] = {}
    for rel in rels:
        names = _top_level_names(rel)
        if not names:
            continue
        mod = importlib.import_module(_module_name(rel))
        for n in names:
            if not hasattr(mod, n):
                continue  # deleted after use (``del _tiers``)
            c = _canonical_value(getattr(mod, n))
            if c is not _SKIP:
                out[f"{rel.split('/', 1)[1]}:{n}"] = _canonical_json(c)
    return out


FORWARD_SOURCES = ("forward.py", "state.py", "caches.py", "layers")
QUANTIZATION_SOURCES = ("dsl/weights.py", "layers/weight_formats.py", "layers/quantization.py")
ENGINE_SOURCES = {"vllm": ("backends/vllm",), "megatron": ("backends/megatron", "private_state.py")}
"""Package-relative files and folders hashed as ``source.*`` and ``<engine>.source``."""


def _expand(entries: Iterable[str], exclude: Iterable[str] = ()) -> list[str]:
    out = []
    for e in entries:
        p = PACKAGE / e
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        out += [f.relative_to(PACKAGE).as_posix() for f in files]
    skip = set(exclude)
    return sorted(r for r in set(out) if r not in skip and not r.endswith("oracle.py"))


def _op_table(spec) -> dict[str, str]:
    out = {"residual": type(spec.residual).__name__}
    for b in spec.blocks:
        out[f"layer {b.index:04d}"] = " + ".join(type(s.mixer).__name__ for s in b.sublayers)
    return out


def _spec_fields(spec) -> dict[str, str]:
    out = {}
    for f in dataclasses.fields(spec):
        if f.name in ("weight_formats", "blocks", "extra"):
            continue
        out[f.name] = repr(getattr(spec, f.name))
    out["extra"] = repr(sorted((str(k), repr(v)) for k, v in spec.extra.items()))
    for b in spec.blocks:
        out[f"block {b.index:04d}"] = repr(b)
    return out


def _weight_formats(spec) -> dict[str, str]:
    out = {}
    for name, fmt in spec.weight_formats:
        m = fmt.master()
        out[name] = m.format + ("+input_scale" if m.input_scale else "")
    return out


def _dtypes(spec, params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    quantized = tuple(f"{n}." for n, _ in spec.weight_formats)
    out = {"<model dtype>": str(spec.dtype)}
    for name in sorted(spec.parameter_shapes()):
        if name.startswith(quantized):
            continue
        p = params.get(name)
        out[name] = str(p.dtype) if p is not None else "<absent>"
    return out


def _torch_flags() -> dict[str, str]:
    m = torch.backends.cuda.matmul
    return {"cuda.matmul.allow_tf32": str(m.allow_tf32), "cudnn.allow_tf32": str(torch.backends.cudnn.allow_tf32),
            "cuda.matmul.allow_bf16_reduced_precision_reduction": str(m.allow_bf16_reduced_precision_reduction),
            "cuda.matmul.allow_fp16_reduced_precision_reduction": str(m.allow_fp16_reduced_precision_reduction),
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def contract_fingerprint(engine: str, spec, params: Mapping[str, torch.Tensor], device: torch.device | str, *,
                         engine_components: Mapping[str, Any] | None = None) -> Fingerprint:
    """The execution-contract fingerprint of one engine (components: module docstring).

    Args:
        engine: the engine's name (``"vllm"``, ``"megatron"``): prefixes its own components.
        spec: the spec the engine runs (its weight formats are compared in master form).
        params: HF name -> the engine's live parameter (dtypes are read from them).
        device: where the engine computes (decides the dispatched kernel path).
        engine_components: the engine's own components (``version``, ``settings``, ...), named
            without the prefix; ``source`` is added from :data:`ENGINE_SOURCES`.

    Returns:
        :class:`Fingerprint`. Cost: hashing ~0.5 MB of sources and importing the dispatched
        op modules (a few ms once they are imported).
    """
    path = kernel_path(device)
    comps: dict[str, Any] = {"kernel_path": path, "device": _device_name(device)}
    for fam, rels in _family_files(path).items():
        comps[f"kernel_source.{fam}"] = _sources(rels)
        comps[f"kernel_config.{fam}"] = _configs(rels)
    comps["source.quantization"] = _sources(_expand(QUANTIZATION_SOURCES))
    comps["source.forward"] = _sources(_expand(FORWARD_SOURCES, exclude=QUANTIZATION_SOURCES))
    comps["weight_formats"] = _weight_formats(spec)
    comps["dtypes"] = _dtypes(spec, params)
    comps["op_table"] = _op_table(spec)
    comps["spec"] = _spec_fields(spec)
    comps["library.torch"] = library_version("torch")
    comps["library.triton"] = library_version("triton") if path.startswith("triton") else "unused (torch-cpu path)"
    comps["library.numpy"] = library_version("numpy") if path == "triton-interpreter" else "unused"
    comps["numerics.torch_flags"] = _torch_flags()
    own = dict(engine_components or {})
    if engine in ENGINE_SOURCES:
        own.setdefault("source", _sources(_expand(ENGINE_SOURCES[engine])))
    for k, v in own.items():
        comps[f"{engine}.{k}"] = v
    return Fingerprint(engine, comps)


# ============================================================================ weight fingerprint

CHECKSUM_CHUNK = 1 << 20
"""Elements per int64 pass of :func:`tensor_checksum` (bounds its temporaries to 8 MiB x 2)."""

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_MASK = {1: 0xFF, 2: 0xFFFF, 4: 0xFFFFFFFF, 8: None}
_ODD_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_U64 = (1 << 64) - 1


def _odd_weights(device: torch.device) -> torch.Tensor:
    w = _ODD_WEIGHTS.get(device)
    if w is None:
        w = torch.arange(CHECKSUM_CHUNK, dtype=torch.int64, device=device) * 2 + 1
        _ODD_WEIGHTS[device] = w
    return w


@torch.no_grad()
def tensor_checksum(t: torch.Tensor) -> torch.Tensor:
    """``sum_i bits_i * (2 i + 1) mod 2**64`` of a tensor's raw bits, on its own device.

    Args:
        t: any tensor of 1-, 2-, 4- or 8-byte elements (any dtype, any layout; read in
            row-major element order).

    Returns:
        A 0-dim int64 tensor on ``t.device`` (the checksum as a two's-complement int64; no
        host sync). See the module docstring for what it detects and why the order of the
        reduction cannot change it.

    Raises:
        ValueError: an element size other than 1, 2, 4 or 8 bytes.
    """
    flat = t.detach().contiguous().reshape(-1)
    es = flat.element_size()
    if es not in _INT_VIEW:
        raise ValueError(f"tensor_checksum: elements of {es} bytes ({t.dtype}) are not supported")
    bits = flat.view(_INT_VIEW[es]) if flat.dtype != _INT_VIEW[es] else flat
    mask = _UNSIGNED_MASK[es]
    acc = torch.zeros((), dtype=torch.int64, device=flat.device)
    w = _odd_weights(flat.device)
    for start in range(0, bits.numel(), CHECKSUM_CHUNK):
        x = bits[start:start + CHECKSUM_CHUNK].to(torch.int64, copy=True)  # a copy: modified in place below
        if mask is not None:
            x.bitwise_and_(mask)  # the unsigned value of the element's bits
        plain = x.sum()
        # sum_k x_k (2 (start + k) + 1) = sum_k x_k (2k + 1) + 2 start sum_k x_k, all mod 2**64
        acc += x.mul_(w[: x.numel()]).sum() + (2 * start) * plain
    return acc


def tensor_checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """Name -> :func:`tensor_checksum` (as an unsigned 64-bit Python int) of every tensor, each
    computed on its own device; one host read per device."""
    by_dev: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        by_dev.setdefault(t.device, []).append((name, tensor_checksum(t)))
    out: dict[str, int] = {}
    for items in by_dev.values():
        values = torch.stack([c for _, c in items]).tolist() if items else []
        out.update({n: int(v) & _U64 for (n, _), v in zip(items, values)})
    return out


class WeightFingerprintError(RuntimeError):
    """The engine's weights after a sync are not the trainer's: names the tensor(s) and the step.

    Attributes:
        step: the step whose sync failed (None: a sync outside the steps, e.g. at start).
        tensors: the names whose checksums differ (sorted).
    """

    def __init__(self, message: str, step: int | None, tensors: list[str]):
        super().__init__(message)
        self.step = step
        self.tensors = tensors


@dataclass(frozen=True)
class WeightFingerprint:
    """The weights of one sync, as the engine holds them after it.

    Attributes:
        checksums: HF name -> checksum (both sides agreed on each).
        digest: SHA-256 (hex) over ``name=checksum`` lines in name order.
        tensors_checked: how many tensors were compared.
    """

    checksums: Mapping[str, int]
    digest: str
    tensors_checked: int


def verify_weight_sync(source: Mapping[str, int], engine: Mapping[str, int], *, step: int | None = None
                       ) -> WeightFingerprint:
    """Compare the trainer-side and engine-side checksums of one sync, tensor by tensor.

    Args:
        source: name -> checksum of the tensor sent (the trainer's, cast to the engine dtype).
        engine: name -> checksum of the engine's parameter after the copy.
        step: the step whose sync this was (for the message).

    Returns:
        :class:`WeightFingerprint` of the synced weights.

    Raises:
        WeightFingerprintError: a tensor's checksums differ, or a name is on one side only;
            the message names the step, the first tensors and both checksums.
    """
    names = sorted(set(source) | set(engine))
    bad = [n for n in names if source.get(n) != engine.get(n)]
    when = f"after the weight sync of step {step}" if step is not None else "after a weight sync"
    if bad:
        def fmt(v):
            return "absent" if v is None else f"{v:016x}"

        shown = "; ".join(f"{n}: trainer {fmt(source.get(n))} vs engine {fmt(engine.get(n))}" for n in bad[:3])
        more = f" (and {len(bad) - 3} more)" if len(bad) > 3 else ""
        raise WeightFingerprintError(
            f"weight fingerprint mismatch {when}: {len(bad)} of {len(names)} tensors differ in vLLM's buffers "
            f"from what the trainer sent: {shown}{more}", step, bad)
    digest = _sha("\n".join(f"{n}={source[n]:016x}" for n in names))
    return WeightFingerprint(checksums=dict(source), digest=digest, tensors_checked=len(names))
