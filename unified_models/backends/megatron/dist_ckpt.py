"""Megatron distributed checkpoints (``torch_dist``) <-> Hugging Face checkpoints, through Megatron.

The layout (files, common-state entry, digests) is described and written
engine-free in :mod:`unified_models.converters.megatron_dist_ckpt`; this module
is the part that imports Megatron:

Writers: on CUDA (one process) Megatron's own ``dist_checkpointing.save``
(0.19 then stores the common state inside the DCP files instead of
``common.pt``; readers handle both). On CPU Megatron's save cannot run (its
``torch_dist`` writer calls ``torch.cuda.synchronize``), so the same layout is
written through ``torch.distributed.checkpoint.save(no_dist=True)``
(:func:`~unified_models.converters.megatron_dist_ckpt.write_torch_dcp`).
Reading always goes through ``dist_checkpointing.load`` against ShardedTensors
built from the spec.

Megatron's save (0.16 and 0.19) starts a ``multiprocessing`` manager with the
``spawn`` start method for its write-results queue: a script calling the
``"megatron"`` writer needs an ``if __name__ == "__main__":`` guard (spawn
re-imports the main module). Checked on the H200 with megatron-core 0.19.2:
the ``"megatron"`` writer produces the 0.19-native layout (no ``common.pt``),
and both layouts load and convert back bitwise.

Every write goes to a temporary sibling directory that is renamed into place
only when complete: an error leaves nothing half-written. Bad input raises
:class:`CheckpointError` naming the problem.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

import torch

from ...converters import megatron_dist_ckpt as layout
from ...converters import trained_masters
from ...converters.hf_safetensors import (
    canonical_tensors,
    cast_to_stored_dtypes,
    load_hf_config,
    read_tensors,
    stored_tensors,
    tensor_table_problems,
    validate_state_dict,
)
from ...converters.megatron_dist_ckpt import (
    ASSETS_DIR,
    IO_ERRORS,
    DistCheckpointInfo,
    Writer,
    describe_error,
    verify_digests,
)
from ...converters.safetensors_io import save_safetensors
from ...dsl import CheckpointError, ModelSpec, SpecError, UnifiedModelsError
from ...paths import check_destination
from ...serving.vocabulary import pad_tokenizer_dir
from . import compat
from .parallel import ensure_process_group

__all__ = [
    "save_dist_checkpoint", "load_dist_checkpoint", "check_dist_checkpoint", "hf_to_megatron",
    "megatron_to_hf", "dist_rank_world",
]


def dist_rank_world() -> tuple[int, int]:
    """``(rank, world size)`` of ``torch.distributed``; ``(0, 1)`` when it is not initialized."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _write_megatron(ckpt_dir: Path, tensors: Mapping[str, torch.Tensor], common: dict) -> None:
    """Megatron's own ``dist_checkpointing.save`` (CUDA tensors, one process)."""
    ensure_process_group()
    device = torch.device("cuda", torch.cuda.current_device())
    sharded: dict[str, Any] = {k: compat.plain_sharded_tensor(t.detach().to(device).contiguous(), k)
                               for k, t in tensors.items()}
    sharded.update(common)
    compat.dist_save(sharded, ckpt_dir)


def _resolve_writer(writer: Writer) -> str:
    if writer not in ("auto", "megatron", "torch_dcp"):
        raise ValueError(f"writer must be 'auto', 'megatron' or 'torch_dcp', got {writer!r}")
    _, world = dist_rank_world()
    if writer == "auto":
        return "megatron" if torch.cuda.is_available() and world == 1 else "torch_dcp"
    if writer == "megatron":
        if not torch.cuda.is_available():
            raise CheckpointError("writer='megatron' needs CUDA: Megatron's torch_dist writer calls "
                                  "torch.cuda.synchronize(); use writer='torch_dcp' on CPU")
        if world != 1:
            raise CheckpointError("writer='megatron' writes whole tensors from one process; run the converter "
                                  f"in a single process (world size is {world})")
    return writer


def save_dist_checkpoint(state_dict: Mapping[str, torch.Tensor], config: Any, out_dir: str | os.PathLike, *,
                         spec: ModelSpec | None = None, assets_from: str | os.PathLike | None = None,
                         writer: Writer = "auto", overwrite: bool = False) -> Path:
    """Write a canonical state dict as a Megatron ``torch_dist`` checkpoint.

    Args:
        state_dict: ``{HF name: tensor}`` exactly as the spec lists it (dtypes kept).
        config: the Hugging Face config (dict, ``config.json`` text or
            transformers config); stored for the reverse conversion.
        out_dir: checkpoint directory (must not exist or be empty, unless ``overwrite``).
        spec: the model; default: built from ``config``.
        assets_from: a Hugging Face directory whose tokenizer / generation
            files are carried along (``hf_assets/``).
        writer: ``"megatron"`` (Megatron's save; CUDA, one process),
            ``"torch_dcp"`` (CPU-capable, 0.16 layout) or ``"auto"`` (megatron
            when CUDA is available and the world is one process).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: tensors do not match the spec (all named), NaN/Inf,
            unusable config, output exists, or the write failed (nothing left behind).
    """
    text = layout.config_text(config)
    config_spec = layout.spec_from_config_text(text, source="save_dist_checkpoint")
    if spec is None:
        spec = config_spec
    elif spec.parameter_shapes() != config_spec.parameter_shapes():
        raise CheckpointError("save_dist_checkpoint: the given spec and config describe different models "
                              "(the stored config must rebuild the spec on load)")
    validate_state_dict(dict(state_dict), spec, source="state_dict")
    kind = _resolve_writer(writer)
    rank, world = dist_rank_world()
    out = Path(out_dir)
    tensors = {name: state_dict[name] for name in spec.parameter_shapes()}
    digests = {name: layout.tensor_digest(t) for name, t in tensors.items()}
    common = {layout.COMMON_KEY: layout.common_entry(spec, text, writer=kind, digests=digests)}
    if rank == 0:
        with layout.atomic_output_dir(out, overwrite) as tmp:
            try:
                if kind == "megatron":
                    _write_megatron(tmp, tensors, common)
                else:
                    layout.write_torch_dcp(tmp, tensors, common)
                if assets_from is not None:
                    layout.copy_assets(Path(assets_from), tmp / ASSETS_DIR)
                    pad_tokenizer_dir(tmp / ASSETS_DIR, spec.vocab_size)  # every id detokenizes (serving)
            except UnifiedModelsError:
                raise
            except IO_ERRORS as e:  # noqa: BLE001 - reported as a failed write; the temp dir is removed
                raise CheckpointError(f"writing Megatron checkpoint {out} failed: {describe_error(e)}") from e
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    return out


def check_dist_checkpoint(ckpt_dir: str | os.PathLike, *, spec: ModelSpec | None = None) -> DistCheckpointInfo:
    """Validate a checkpoint's layout, common state and tensor list without reading tensor data.

    Also accepts a training checkpoint written by
    :func:`~unified_models.backends.megatron.checkpoint.save_training_checkpoint`
    with an ``hf_config``: its optimizer tensors (keys under the prefixes the
    common entry lists in ``extra_tensor_prefixes``) are not model tensors. A
    training checkpoint of a quantized model's masters holds the masters' spec of
    its quantization recipe (:mod:`unified_models.converters.trained_masters`),
    which ``spec`` and the stored tensors are compared with.

    Args:
        ckpt_dir: checkpoint directory.
        spec: if given, the checkpoint must hold exactly this model's parameters.

    Returns:
        :class:`~unified_models.converters.megatron_dist_ckpt.DistCheckpointInfo`.

    Raises:
        CheckpointError: missing directory, not a ``torch_dist`` checkpoint,
            not written by unified_models, unreadable metadata, or missing /
            unexpected / mis-shaped tensors (all named).
    """
    d = layout.check_layout_files(ckpt_dir)
    ensure_process_group()
    try:
        common = compat.load_common_state_dict(d)
    except IO_ERRORS as e:  # noqa: BLE001
        raise layout.common_state_error(d, e) from None
    entry = layout.parse_common_entry(common, str(d))
    text = entry["hf_config_json"]
    recipe = None
    if entry.get(layout.RECIPE_KEY) is not None:
        recipe = trained_masters.QuantizationRecipe.from_entry(entry[layout.RECIPE_KEY], str(d))
        ckpt_spec = recipe.master_spec(str(d))
    else:
        ckpt_spec = layout.spec_from_config_text(text, source=str(d))
    if spec is not None and spec.parameter_shapes() != ckpt_spec.parameter_shapes() and recipe is not None:
        problems = tensor_table_problems(ckpt_spec.parameter_shapes(), spec.parameter_shapes(), verb="requested")
        raise CheckpointError(f"{d} holds the masters of a quantized model (trained under {recipe.describe()}), "
                              f"not the requested {spec.family} spec's tensors (" + "; ".join(problems) + "); "
                              "`unified-models convert --from megatron` writes them as a plain checkpoint")
    if spec is not None and spec.parameter_shapes() != ckpt_spec.parameter_shapes():
        raise CheckpointError(f"{d} holds a different model than the requested {spec.family} spec "
                              f"({len(ckpt_spec.blocks)} layers, hidden {ckpt_spec.hidden_size} in the checkpoint; "
                              f"{len(spec.blocks)} layers, hidden {spec.hidden_size} requested)")
    try:
        metadata = compat.load_tensors_metadata(d)
    except IO_ERRORS as e:  # noqa: BLE001
        raise CheckpointError(f"{d}/.metadata is unreadable (corrupt checkpoint): {describe_error(e)}") from None
    skip = tuple(entry.get("extra_tensor_prefixes") or ())
    metadata = {n: m for n, m in metadata.items() if not (skip and n.startswith(skip))}
    problems = tensor_table_problems(ckpt_spec.parameter_shapes(),
                                     {n: tuple(m.global_shape) for n, m in metadata.items()}, verb="stored")
    if problems:
        what = "its quantization recipe's masters" if recipe is not None else f"its {ckpt_spec.family} config"
        raise CheckpointError(f"Megatron checkpoint {d} does not match {what}; " + "; ".join(problems))
    return DistCheckpointInfo(config_text=text, spec=ckpt_spec, tensors_metadata=metadata,
                              digests=entry.get("sha256") or {}, recipe=recipe)


def _load(ckpt_dir: str | os.PathLike, device: torch.device | str, check_finite: bool,
          info: DistCheckpointInfo | None = None):
    """``(info, {name: tensor})`` of every model tensor the checkpoint holds (``info.spec``'s)."""
    info = info or check_dist_checkpoint(ckpt_dir)
    spec, metadata = info.spec, info.tensors_metadata
    rank, _ = dist_rank_world()
    template = {
        name: compat.plain_sharded_tensor(
            torch.empty(shape, dtype=metadata[name].dtype, device=device), name, replica_id=rank)
        for name, shape in spec.parameter_shapes().items()
    }
    try:
        loaded = compat.dist_load(template, ckpt_dir)
    except IO_ERRORS as e:  # noqa: BLE001 - any reader failure means a corrupt checkpoint
        raise CheckpointError(f"Megatron checkpoint {ckpt_dir} could not be read (corrupt?): "
                              f"{describe_error(e)}") from None
    tensors = {name: loaded[name] for name in spec.parameter_shapes()}
    verify_digests(tensors, info.digests, str(ckpt_dir))
    validate_state_dict(tensors, spec, source=str(ckpt_dir), check_finite=check_finite)
    return info, tensors


def load_dist_checkpoint(ckpt_dir: str | os.PathLike, *, device: torch.device | str = "cpu",
                         check_finite: bool = True) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read a checkpoint through ``megatron.core.dist_checkpointing.load``.

    The sharded state dict is built from the stored config's spec (names and
    shapes) with the stored dtypes; tensors come back whole (TP=1). For a
    training checkpoint of a quantized model's masters, the config is the
    masters' (no ``quantization_config``) and the state dict holds the tensors it
    lists, as :func:`megatron_to_hf` writes them (the recipe's static scales left
    out: :func:`check_dist_checkpoint` gives the recipe).

    Returns:
        ``(config_json, state_dict)``: the Hugging Face config dict and ``{HF name: tensor}`` under the
        spec's canonical names (for a DeepSeek-V4 config in the published layout too, which
        :func:`megatron_to_hf` writes in that layout).

    Raises:
        CheckpointError: see :func:`check_dist_checkpoint`; unreadable tensor
            data (corrupt files); NaN/Inf when ``check_finite``.
    """
    info, tensors = _load(ckpt_dir, device, check_finite)
    if info.recipe is not None:
        _, tensors = trained_masters.masters_hf_state_dict(tensors, info.config_text, source=str(ckpt_dir))
    return json.loads(info.config_text), tensors


def hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, writer: Writer = "auto",
                   overwrite: bool = False) -> Path:
    """Convert a Hugging Face checkpoint (config.json + safetensors) to a Megatron checkpoint.

    Tensors keep their names and dtypes; ``config.json`` is stored verbatim;
    tokenizer and generation-config files travel in ``hf_assets/``. A checkpoint in a
    family's other layout (DeepSeek-V4's published names, int32 ``tid2eid``, float32
    ``.scale``) is stored under the spec's canonical names and dtypes, as every engine
    loads it (:func:`unified_models.converters.hf_safetensors.canonical_tensors`);
    :func:`megatron_to_hf` writes it back in its own layout.

    Raises:
        CheckpointError: missing directory / config / weights, corrupt files,
            tensors not matching the config (all named), NaN/Inf, output exists.
        SpecError: the config declares something unsupported.
        UnifiedModelsError: ``out_dir`` is ``hf_dir``, holds it or lies inside it
            (:func:`unified_models.paths.check_destination`).
    """
    from ...models import spec_from_hf_config

    check_destination(hf_dir, out_dir, src_name="the HF checkpoint", dst_name="the output")
    src = Path(hf_dir)
    config = load_hf_config(src)
    try:
        spec = spec_from_hf_config(config)
    except SpecError as e:
        raise type(e)(f"{src}/config.json: {e}") from None
    text = (src / "config.json").read_bytes().decode("utf-8")
    tensors = canonical_tensors(src, read_tensors(src))
    validate_state_dict(tensors, spec, source=str(src))
    # what every load checks beyond names, shapes and finite weights: code dtypes and the quantized
    # tensors' values (NaN / zero scales); the tensors are stored as they are, not cast
    cast_to_stored_dtypes(tensors, spec, source=str(src))
    return save_dist_checkpoint(tensors, text, out_dir, spec=spec, assets_from=src, writer=writer,
                                overwrite=overwrite)


def megatron_to_hf(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                   requantize: bool = False) -> Path:
    """Convert a Megatron checkpoint (:func:`save_dist_checkpoint`'s, or a training checkpoint
    saved with its config) back to Hugging Face.

    Writes ``model.safetensors`` (same names and dtypes), the original
    ``config.json`` text and the carried tokenizer / generation files. The tensors
    are written in the layout of the ``config.json`` written: a DeepSeek-V4 config in
    DeepSeek's published layout gets the published tensor names and dtypes
    (:func:`unified_models.converters.hf_safetensors.stored_tensors`), so a published
    checkpoint converted to Megatron (or trained from by ``rl --save``) comes back as it
    was, bit for bit. A training
    checkpoint of a quantized model's masters (``rl --save`` on a ModelOpt or
    block-FP8 checkpoint; :mod:`unified_models.converters.trained_masters`) gives
    its masters in the model dtype under the masters' config (no
    ``quantization_config``), or with ``requantize`` the masters quantized under
    the recorded recipe (the rule of every weight sync into vLLM, the recorded
    static scales) with the recorded ``config.json`` and ``hf_quant_config.json``.

    Args:
        ckpt_dir: the checkpoint (for a training checkpoint, one ``iter_*`` directory).
        out_dir: the Hugging Face directory to write.
        overwrite: replace a non-empty ``out_dir``.
        requantize: write the masters of a quantized model quantized again.

    Raises:
        CheckpointError: see :func:`load_dist_checkpoint`; output exists;
            ``requantize`` on a checkpoint that records no quantization recipe;
            a recipe the masters cannot be quantized under (named).
    """
    check_destination(ckpt_dir, out_dir, src_name="the Megatron checkpoint", dst_name="the output")
    info = check_dist_checkpoint(ckpt_dir)
    source = str(ckpt_dir)
    if requantize and info.recipe is None:
        quantized = " (its tensors are stored quantized already)" if info.spec.stores_quantized_weights else ""
        raise CheckpointError(f"{source} records no quantization recipe{quantized}: it holds the model its "
                              "config.json describes, which converts as it is; re-quantizing applies to a training "
                              "checkpoint of a quantized model's masters (`rl --save` on a ModelOpt or block-FP8 "
                              "checkpoint); for a new quantized export use `unified-models quantize`")
    _, tensors = _load(ckpt_dir, "cpu", True, info)
    text, quant_text = info.config_text, None
    if info.recipe is not None and requantize:
        spec, tensors = trained_masters.requantized_state_dict(tensors, info.recipe, source=source)
        text, quant_text = info.recipe.config_text, info.recipe.hf_quant_config_text
    elif info.recipe is not None:
        spec, tensors = trained_masters.masters_hf_state_dict(tensors, text, source=source)
    else:
        spec = info.spec
    tensors = stored_tensors(text, tensors, source=source)  # the config's layout (DeepSeek-V4's published one)
    out = Path(out_dir)
    with layout.atomic_output_dir(out, overwrite) as tmp:
        try:
            save_safetensors({k: v.contiguous() for k, v in tensors.items()}, tmp / "model.safetensors",
                             metadata={"format": "pt"})
            (tmp / "config.json").write_bytes(text.encode("utf-8"))
            layout.copy_assets(Path(ckpt_dir) / ASSETS_DIR, tmp)
            if info.recipe is not None:  # the recipe's own quantization file, or none for the masters
                (tmp / "hf_quant_config.json").unlink(missing_ok=True)
                if quant_text is not None:
                    (tmp / "hf_quant_config.json").write_bytes(quant_text.encode("utf-8"))
            pad_tokenizer_dir(tmp, spec.vocab_size)
        except IO_ERRORS as e:  # noqa: BLE001
            raise CheckpointError(f"writing Hugging Face checkpoint {out} failed: {describe_error(e)}") from e
    return out
