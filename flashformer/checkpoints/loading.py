"""Loading a model to use it, from wherever it lives:

- a run folder of `flashformer train` (its newest complete checkpoint),
- one checkpoint folder `step-*` (verified against its manifest first),
- a Hugging Face folder: config.json with a "model_type", the weights, and
  (for `load`) tokenizer.json,
- a GGUF file (llama.cpp's format): the model, its tokenizer and its chat
  template in one file (flashformer.checkpoints.gguf).

    model = flashformer.from_pretrained(path)            # the model, in eval mode
    model, tokenizer = flashformer.load(path)            # and the tokenizer it was trained with
    tokenizer = load_tokenizer(path)                     # the tokenizer alone

A GGUF file runs on its own quantized blocks by default (quantize="auto"), as llama.cpp,
llama-cpp-python and ollama run it: its users type no flag, and an 8B Q4_K_M file expanded to
float32 would need 32 GB. quantize=None is the float path (every weight dequantized to float32,
as transformers' GGUF loader reads it).

`export_hf` writes a run's model as a Hugging Face folder, `export_gguf` a run's or a
Hugging Face folder's model as a GGUF file (for llama.cpp and ollama).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError

from flashformer.checkpoints import checkpoint as ckpt
from flashformer.checkpoints.checkpoint import CheckpointError
from flashformer.checkpoints.gguf import GGUFCheckpoint, QuantizedTensor, read_gguf
from flashformer.checkpoints.gguf.tokenizer import read_tokenizer, tokenizer_from_metadata
from flashformer.checkpoints.mxfp4_folder import dequantized, is_mxfp4_folder, read_mxfp4_folder
from flashformer.files import publish_folder
from flashformer.kernels.huge_pages import use_huge_pages
from flashformer.model import hf
from flashformer.model.config import ModelConfig
from flashformer.model.models import PreTrainedModel, build, build_with_weights
from flashformer.model.quantize import DEFAULT_ACTIVATIONS, MODES, quantize
from flashformer.startup import paused_gc
from flashformer.text.bpe import read_saved_tokenizer

AUTO = "auto"  # quantize's default: a GGUF file's own blocks, a folder's weights as stored
# the kinds of source whose weights are stored as blocks a quantized kernel runs as they are
BLOCK_SOURCES = ("gguf", "mxfp4")
# what quantize takes, as typed on a command line: "none" (or None) is the float path
QUANTIZE_CHOICES = (AUTO, "none", *MODES)


def resolve_quantize(quantize: str | None, kind: str, dtype: torch.dtype | None = None) -> str | None:
    """quantize as the loader applies it to a source of this kind ("gguf", "mxfp4", "hf",
    "checkpoint"): "auto" is "gguf" for a GGUF file and a folder of MXFP4 experts (their blocks as
    stored), None (as stored) for another folder; "none" is None; the rest as given."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise ValueError(f"quantize must be one of {QUANTIZE_CHOICES} or None; got {quantize!r}")
    if quantize != AUTO:
        return None if quantize == "none" else quantize
    if kind not in BLOCK_SOURCES:
        return None
    if dtype not in (None, torch.float32):
        source = "a GGUF file" if kind == "gguf" else "a folder of MXFP4 experts"
        raise ValueError(
            f"dtype={dtype}: {source} runs on its own quantized blocks by default, whose layers take "
            f"float32 activations; pass quantize=None for the float path in {dtype}"
        )
    return "gguf"


def quantize_mode(path: str | Path, quantize: str | None = AUTO) -> str | None:
    """The quantize mode load(path, quantize=...) applies: what a benchmark records of a run."""
    return resolve_quantize(quantize, locate(path)[0])


def locate(path: str | Path) -> tuple[str, Path]:
    """("gguf" | "hf" | "mxfp4" | "checkpoint", the file or folder to read) for a GGUF file or a
    run, checkpoint or Hugging Face folder ("mxfp4": one whose experts are MXFP4 blocks)."""
    folder = Path(path)
    if folder.is_file() and _starts_like_gguf(folder):
        return "gguf", folder
    if not folder.is_dir():
        raise CheckpointError(
            f"{folder} does not exist or is neither a GGUF file nor a folder (run, checkpoint or Hugging Face)"
        )
    if (folder / ckpt.MANIFEST).is_file():
        return "checkpoint", folder
    config = _read_config(folder)
    if "model_type" in config:
        return ("mxfp4" if is_mxfp4_folder(config) else "hf"), folder
    steps = ckpt.list_checkpoints(folder)
    if not steps:
        raise CheckpointError(
            f"{folder} is neither a run folder (no step-* checkpoint inside), a checkpoint folder "
            f"(no {ckpt.MANIFEST}) nor a Hugging Face folder (no config.json with a model_type)"
        )
    return "checkpoint", steps[-1]


def from_pretrained(
    path: str | Path,
    dtype: torch.dtype | None = None,
    quantize: str | None = AUTO,
    activations: str = DEFAULT_ACTIVATIONS,
    adapters=None,
) -> PreTrainedModel:
    """The model of a GGUF file or a run, checkpoint or Hugging Face folder, in eval mode.

    dtype: None keeps the stored dtype (transformers' "auto"; a GGUF file's float path gives float32).
    quantize: "auto" (the default: "gguf" for a GGUF file, None for a folder), None (float weights:
    a GGUF file dequantized to float32), "int8" or "int4" (any float decoder, quantized here), or
    "gguf" (a GGUF file's own blocks with no float32 copy of them: K-quants used in place from the
    file's memory map, Q4/Q5/Q8 blocks repacked once from it; the model holds about the file's
    size); see flashformer.model.quantize. activations: what a quantized layer does
    with its input, a scheme of model.quantize.ACTIVATION_SCHEMES: "int8-int8x2-head" (the default:
    int8 blocks of 32 as llama.cpp's, the output head's input ~15 bits), "int8", "float32" (exact
    with respect to the quantized weights, slower) or "int8-float32-head". adapters: LoRA adapters
    added beside the (possibly quantized) projections, all active: a PEFT folder, a list of them
    (each named by its folder) or {name: folder} (flashformer.adapters). A Hugging Face folder's problems
    raise ValueError naming the tensor or option at fault; a damaged checkpoint raises
    CheckpointError naming the file.
    """
    use_huge_pages()
    kind, where = locate(path)
    quantize = resolve_quantize(quantize, kind, dtype)
    if kind == "gguf":
        return _load_gguf(where, dtype, quantize, activations, with_tokenizer=False, adapters=adapters)[0]
    if kind == "mxfp4":
        return _with_adapters(_load_mxfp4_folder(where, dtype, quantize, activations), adapters)
    if kind == "hf":
        model = build_with_weights(*hf.read_pretrained(where))
    else:
        model = _load_checkpoint(where)
    return _with_adapters(_finish(model, dtype, quantize, activations, None), adapters)


def _with_adapters(model: PreTrainedModel, adapters) -> PreTrainedModel:
    """The adapters beside the finished model's projections: after quantizing, so that a quantized
    base keeps its blocks and the low-rank product runs beside them."""
    if adapters is not None:
        from flashformer.adapters.peft import load_adapters  # imported only when asked for

        load_adapters(model, adapters)
    return model


def _finish(model: PreTrainedModel, dtype, quantize_mode: str | None, activations: str, checkpoint):
    if dtype is not None:
        model = model.to(dtype)
    if quantize_mode is not None:
        model = quantize(model, quantize_mode, checkpoint, activations)
    return model.eval()


def load(
    path: str | Path,
    dtype: torch.dtype | None = None,
    quantize: str | None = AUTO,
    activations: str = DEFAULT_ACTIVATIONS,
    adapters=None,
):
    """(model in eval mode, tokenizer) from a GGUF file or a run, checkpoint or Hugging Face
    folder; dtype, quantize, activations and adapters as in from_pretrained.

    Raises CheckpointError naming the folder and what is missing or damaged.
    """
    use_huge_pages()
    kind, folder = locate(path)
    quantize = resolve_quantize(quantize, kind, dtype)
    if kind == "gguf":  # one read of the file serves the model and the tokenizer
        return _load_gguf(folder, dtype, quantize, activations, with_tokenizer=True, adapters=adapters)
    try:
        model = from_pretrained(folder, dtype, quantize, activations, adapters)
    except (ValueError, OSError, SafetensorError) as error:
        if kind not in ("hf", "mxfp4"):
            raise
        raise CheckpointError(f"cannot load the Hugging Face model in {folder}: {error}") from None
    return model, _load_tokenizer(folder)


@functools.cache
def load_draft_model(path: str | Path, quantize: str | None = AUTO, activations: str = DEFAULT_ACTIVATIONS):
    """A draft model for speculative decoding (generate's assistant_model, --speculative-config's
    "model"), loaded once per path and options: the one loader of `generate --draft`, `chat` (which
    asks for its settings every turn), `serve`, its replicas and the speculative benchmark."""
    model, _ = load(path, quantize=quantize, activations=activations)
    return model


def load_tokenizer(path: str | Path):
    """The tokenizer of a GGUF file (its metadata only) or of a run, checkpoint or Hugging Face
    folder, without loading the model. Raises CheckpointError as load() does."""
    kind, where = locate(path)
    if kind == "gguf":
        return read_tokenizer(where)
    return _load_tokenizer(where)


def _merged(path, adapters):
    """(float model, tokenizer) of `path` with `adapters` (load's argument) merged into its weights."""
    from flashformer.adapters.lora import merge_adapters  # imported only when asked for

    # float weights (a GGUF file's dequantized): a quantized block cannot take a merge
    model, tokenizer = load(path, quantize=None, adapters=adapters)
    return merge_adapters(model), tokenizer


def export_hf(path: str | Path, folder: str | Path, adapters=None) -> Path:
    """Write the model of a run or checkpoint as a Hugging Face folder
    (config.json, model.safetensors, tokenizer.json) that transformers loads; `adapters` (LoRA,
    as load takes them) merged into its float weights first.

    The folder is written beside its final place and renamed into it, as a
    checkpoint is: an interrupted export leaves the previous one (or none).
    """
    model, tokenizer = _merged(path, adapters)
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".tmp-{folder.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
    except ValueError as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"cannot export {path} to Hugging Face format: {error}") from None
    tokenizer.save(tmp)
    publish_folder(tmp, folder)
    return folder


def export_gguf(
    path: str | Path,
    out: str | Path,
    file_type: str = "f16",
    force: bool = False,
    show_progress: bool = True,
    adapters=None,
) -> dict[str, str]:
    """Write the model of a run, checkpoint or Hugging Face folder (llama or gpt2 family) and
    its tokenizer as one GGUF file; file_type "f16", "q8_0" or "q4_k_m" (llama.cpp's mix);
    `adapters` (LoRA, as load takes them) merged into its float weights first.
    Returns {tensor: ggml type}.

    The file appears whole or not at all. An existing `out` is kept unless force=True (a
    FileExistsError says so); a GGUF file as the source is refused (it is one already)."""
    from flashformer.checkpoints.gguf.writer import FILE_TYPES, write_gguf  # gguf's writer: export only

    if file_type not in FILE_TYPES:
        raise ValueError(f"--type must be one of {', '.join(FILE_TYPES)}; got {file_type!r}")
    out = Path(out)
    if out.exists() and not force:
        raise FileExistsError(f"{out} exists; pass --force (force=True) to replace it")
    kind, where = locate(path)
    if kind == "gguf":
        raise ValueError(
            f"{path} is a GGUF file already; export takes a run, checkpoint or Hugging Face folder"
        )
    model, tokenizer = _merged(where, adapters)
    try:
        hf_config, weights = hf.to_hf(model)
    except ValueError as error:
        raise ValueError(f"{path}: cannot be exported to GGUF: {error}") from None
    del model  # the tensors live on in `weights`
    return write_gguf(
        out,
        hf_config,
        weights.pop,  # each tensor is dropped once written
        tokenizer,
        file_type,
        name=Path(path).resolve().name,
        source=str(path),
        show_progress=show_progress,
    )


def _starts_like_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _load_gguf(
    path: Path, dtype, quantize_mode: str | None, activations: str, with_tokenizer: bool, adapters=None
):
    """(model, tokenizer or None) from one read of a GGUF file."""
    with paused_gc():  # the metadata's, the tokenizer's and the modules' objects all live on
        checkpoint = read_gguf(path, dequantize=quantize_mode != "gguf", show_progress=False)
        with _one_thread():
            if quantize_mode == "gguf":
                model = _quantized_model_from_gguf(checkpoint, dtype, activations)
            else:
                model = _finish(_model_from_gguf(checkpoint), dtype, quantize_mode, activations, checkpoint)
        tokenizer = tokenizer_from_metadata(checkpoint.metadata, source=str(path)) if with_tokenizer else None
    # the pages read to repack or dequantize leave the RSS; a layer's own (the K-quants' blocks,
    # in place) come back at its first read. The map itself lives on while a layer uses it.
    checkpoint.mapping.drop_resident_pages()
    del checkpoint  # the blocks' copies, before the heap is trimmed
    _return_freed_memory()
    return _with_adapters(model, adapters), tokenizer


def _load_mxfp4_folder(folder: Path, dtype, quantize_mode: str | None, activations: str) -> PreTrainedModel:
    """A gpt-oss folder of MXFP4 experts (checkpoints/mxfp4_folder.py): with quantize="gguf" its
    experts run as the file's blocks run (repacked into GGUF's layout, never dequantized), the rest
    float32; otherwise the float model (experts dequantized exactly), then quantize_mode's."""
    checkpoint = read_mxfp4_folder(folder)
    if quantize_mode == "gguf":
        checkpoint.tensors = {name: tensor.float() for name, tensor in checkpoint.tensors.items()}
        with _one_thread():
            return _quantized_model_from_gguf(checkpoint, dtype, activations)
    state = hf.state_from_hf(checkpoint.config, dequantized(checkpoint), str(folder))
    return _finish(build_with_weights(*state), dtype, quantize_mode, activations, None)


def _return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim). The repacking's
    temporaries, a few MB each, are freed between the packed layers they helped build; the heap
    keeps those holes, and the process's RSS with them: 22 MB more after loading a 72 MB file."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to do
        return
    trim(0)


@contextlib.contextmanager
def _one_thread():
    """Loading a GGUF file is hundreds of copies and repacks of a few MB each, which torch
    splits over its threads: on a busy 2-core machine the threads' hand-offs made SmolLM2's
    quantized load 8-10 s with 2 threads against 0.8-1.0 s with one (same run)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _model_from_gguf(checkpoint: GGUFCheckpoint) -> PreTrainedModel:
    """The float32 model of a GGUF file: the file's weights as gguf's dequantizer gives them,
    under transformers' names, turned into ours by the same family rules as a folder's."""
    return build_with_weights(*hf.state_from_hf(checkpoint.config, checkpoint.tensors, str(checkpoint.path)))


def _quantized_model_from_gguf(checkpoint: GGUFCheckpoint, dtype, activations: str) -> PreTrainedModel:
    """quantize="gguf" without a float32 copy of any weight a quantized kernel takes.

    The model is built with every weight that has a block-quantized part left on the meta
    device (a shape, no memory), quantize() replaces the layers whose blocks a kernel reads
    (kernels.quantized.GGUF_TYPES) with layers holding the repacked blocks, and only what it
    left behind (types no kernel reads, or a fused projection it did not take) is dequantized
    then, with the same family rule and the same dequantizer as the float load: the same
    weights, bit for bit. The K-quants' blocks stay in the file's memory map, used in place; the
    other types are read from it once, by the repacking.
    """
    source = str(checkpoint.path)
    placeholders = {
        name: torch.empty(record.shape[::-1] if record.hf_transposed else record.shape, device="meta")
        for name, record in checkpoint.quantized.items()
    }
    on_meta = {name: tensor.to("meta") for name, tensor in checkpoint.tensors.items()}
    config, skeleton = hf.state_from_hf(
        checkpoint.config, {**on_meta, **placeholders}, source
    )  # names, shapes

    layout = hf.family(config.hf_model_type)
    theirs = layout.strip_prefix({**checkpoint.tensors, **checkpoint.quantized})
    rules = {rule.ours: rule for rule in layout.rules(config)}

    def has_blocks(name: str) -> bool:
        return any(isinstance(theirs[part], QuantizedTensor) for part in rules[name].theirs)

    def materialize(name: str) -> torch.Tensor:  # ours <- theirs, blocks dequantized
        return rules[name].load([_dequantized(theirs[part]) for part in rules[name].theirs])

    state = {name: t if has_blocks(name) else materialize(name) for name, t in skeleton.items()}
    model = _finish(build_with_weights(config, state), dtype, "gguf", activations, checkpoint)
    left = {name: materialize(name) for name, p in model.named_parameters() if p.is_meta}
    model.load_state_dict(left, strict=False, assign=True)
    still = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still:  # a rule or a quantized layer that took a name and gave nothing back
        raise RuntimeError(f"{source}: loading left {len(still)} tensors without values: {still[:5]}")
    return model


def _dequantized(tensor) -> torch.Tensor:
    """A float tensor as it is; a QuantizedTensor as float32 in transformers' layout."""
    if not isinstance(tensor, QuantizedTensor):
        return tensor
    values = tensor.dequantize()  # (out, in)
    return values.t().contiguous() if tensor.hf_transposed else values


def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is corrupt: {error}") from None


LORA_ADAPTER = "lora"  # the name of the adapter a LoRA run of `flashformer train` trains


def lora_run_model(train: dict) -> PreTrainedModel:
    """What a LoRA run of `flashformer train` trains (`train`: its TrainConfig's fields): its base
    (train.base, float32 or quantized as train.base_quantize says: the adapter is trained beside the
    quantized blocks, whose layers pass the gradient on to their inputs) and a fresh adapter
    beside it, as PEFT initializes one (A drawn from torch's global generator, B zero). Every
    parameter but the adapter's (adapter_names) is frozen."""
    from flashformer.adapters.lora import AdapterSettings  # imported only for a LoRA run
    from flashformer.adapters.peft import add_lora

    model = from_pretrained(train["base"], quantize=train.get("base_quantize", "none"))
    settings = AdapterSettings(
        rank=int(train["lora_rank"]), alpha=float(train["lora_alpha"]), dropout=float(train["lora_dropout"])
    )
    add_lora(model, LORA_ADAPTER, settings, train["lora_targets"])
    trainable = adapter_names(model)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable)
    return model


def adapter_names(model) -> set[str]:
    """The names of the LoRA run's adapter parameters (all that its checkpoints hold)."""
    from flashformer.adapters.lora import adapter_parameters

    return set(adapter_parameters(model, LORA_ADAPTER))


def _load_checkpoint(folder: Path) -> PreTrainedModel:
    ckpt.verify_checkpoint(folder)
    config = _read_config(folder)
    if "model" not in config:
        raise CheckpointError(f"{folder / 'config.json'} lacks the model's config (a 'model' entry)")
    try:
        model_config = ModelConfig.from_dict(config["model"])
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{folder / 'config.json'} holds an invalid model config: {error}") from None
    train = config.get("train") or {}
    if train.get("lora_rank"):  # the adapter alone: on its base, read again
        model = lora_run_model(train)
        if model.config.to_dict() != model_config.to_dict():
            raise CheckpointError(
                f"checkpoint {folder} adapts {train['base']}, whose model config is no longer the one the "
                f"adapter was trained on"
            )
        ckpt.load_weights(folder, model, names=adapter_names(model))
        return model
    model = build(model_config)
    ckpt.load_weights(folder, model)
    return model


def _load_tokenizer(folder: Path):
    if not (folder / "tokenizer.json").is_file():
        raise CheckpointError(
            f"{folder} has no tokenizer.json: the text cannot be encoded without the tokenizer the model "
            f"was trained with"
        )
    try:
        return read_saved_tokenizer(folder)
    except Exception as error:  # the tokenizers library raises its own exception types
        raise CheckpointError(f"{folder / 'tokenizer.json'} cannot be read: {error}") from None
