"""Load a target or draft model from a local Hugging Face folder or a .gguf file.

Accepted: a folder with config.json, *.safetensors weights (16-bit, FP8, gpt-oss's MXFP4
experts, bitsandbytes 4-bit, AWQ or GPTQ 4-bit) and tokenizer files, of a supported
decoder-only architecture or a vision-language model whose text model is one (the text model
runs, multimodal.py); or a GGUF file of one. Refused with a clear message: missing paths,
folders without config.json, pickle checkpoints (*.bin, *.pt: loading them can run arbitrary
code), unknown architectures and quantisation formats (by name), corrupt files, and a draft
whose tokenizer vocabulary differs from the target's. trust_remote_code stays off.

Both are built on the meta device and filled tensor by tensor from the memory-mapped file(s)
straight into their final place (materialise.py): peak RAM is the final footprint plus about a
layer. A GGUF's decoder layers stay in the file's own blocks (gguf.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from engine.errors import (
    EngineError,
    InvalidRequest,
    MalformedInput,
    ModelNotFound,
    OutOfMemory,
    UnsupportedModel,
)
from engine.loading.gguf import GGUFWeights, gguf_tokenizer
from engine.loading.layer_plan import MaterialiseSettings
from engine.loading.materialise import materialise
from engine.loading.multimodal import config_object, text_config
from engine.loading.weights import SafetensorsWeights
from engine.model.assistant_spec import is_assistant_folder
from engine.model.cache import steady_attention
from engine.model.causal_lm import CausalLM
from engine.model.eagle_spec import is_eagle_folder
from engine.model.family import layer_kinds
from engine.store import resolve_model
from engine.store.gguf_header import MissingPart, split_parts
from engine.threads import use_compute_threads
from engine.types import Experts, Offload, Quant, Tokenizer
from engine.untrusted import MIB, read_json_file

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_MAX_BYTES = 4 * MIB  # a config.json is a few kB; a vision model's with its processor config, tens


@dataclass
class LoadedModel:
    model: CausalLM
    tokenizer: Tokenizer
    path: Path


def resolve_path(spec: str) -> Path:
    """A --target/--draft value -> a local path: an existing path, else a model from the store."""
    path = Path(spec).expanduser()
    if path.exists():
        try:
            str(path.resolve()).encode("utf-8")  # bytes that are not UTF-8 are kept as lone surrogates
        except UnicodeEncodeError:
            raise UnsupportedModel(f"'{path}' cannot be loaded: its path holds bytes that are not UTF-8 text, which "
                                   "the model readers cannot open. Rename the folder or file (letters in any script "
                                   "are fine).") from None
        return path
    found = resolve_model(spec)  # a catalog id or owner/name repo id in the model store
    if found is not None:
        return Path(found)
    raise ModelNotFound(
        f"No model at '{spec}'. Give a folder with config.json and .safetensors files, a .gguf "
        "file, or the id of a downloaded model (see `specchat models list`)."
    )


def check_folder(path: Path) -> dict:
    """Validate a Hugging Face folder without loading weights; return its config dict (a
    vision-language wrapper's is checked as its text model's, multimodal.py)."""
    check_entries(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UnsupportedModel(
            f"'{path}' has no config.json, so it is not a Hugging Face model folder. "
            "Point to the folder that holds config.json and the .safetensors files."
        )
    try:
        config = read_json_file(config_file, what="the model's config.json", max_bytes=CONFIG_MAX_BYTES)
    except MalformedInput as exc:
        raise UnsupportedModel(f"{exc.user_message} Re-download the model.") from None
    except OSError as exc:
        raise UnsupportedModel(f"'{config_file}' cannot be read ({exc.strerror}); re-download the model.") from exc
    if not isinstance(config, dict):
        raise UnsupportedModel(f"'{config_file}' is not a JSON object; re-download the model.")
    check_config(config, path.name)
    text = text_config(config, path.name)  # a vision-language wrapper: its text model is what runs
    if text is not None:
        check_config(text, path.name)
    layer_kinds(text or config, path.name)  # before transformers' own validators, whose messages say less
    check_quantisation(path.name, (text or config).get("quantization_config"))
    if not any(path.glob("*.safetensors")):
        pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        if pickles:
            raise UnsupportedModel(
                f"'{path.name}' has only pickle weights ({pickles[0]}); they can run code when "
                "loaded, so SpecChat refuses them. Download the .safetensors version of the model."
            )
        raise UnsupportedModel(f"'{path}' holds no .safetensors weights; re-download the model.")
    return config


def check_entries(path: Path) -> None:
    """UnsupportedModel when the folder holds a named pipe, socket or device (a link is judged
    by what it points to, as the loaders read it): the tokenizer and weight readers open what
    they find, and opening a FIFO blocks for ever."""
    try:
        entries = list(path.iterdir())
    except OSError as exc:
        raise ModelNotFound(f"Cannot read the folder '{path}': {exc.strerror}.") from exc
    for entry in entries:
        try:
            mode = entry.stat().st_mode
        except OSError:  # a broken link: the checks below name what is missing
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise UnsupportedModel(f"'{entry.name}' in the model folder '{path}' is not a file (a named pipe, socket "
                                   "or device); a model folder holds files: remove it or re-download the model.")


# Sizes no decoder-only model comes near: anything past them is a damaged config.json, caught
# before a model of that size is built (even on the meta device, a million layers take hours).
CONFIG_LIMITS = {"num_hidden_layers": 10_000, "hidden_size": 1 << 20, "intermediate_size": 1 << 22,
                 "num_attention_heads": 1 << 14, "num_key_value_heads": 1 << 14, "vocab_size": 1 << 24,
                 "head_dim": 1 << 14, "max_position_embeddings": 1 << 28}


def check_config(config: object, name: str) -> None:
    """UnsupportedModel unless config.json is an object whose sizes are whole numbers in range."""
    if not isinstance(config, dict):
        raise UnsupportedModel(f"'{name}' has a config.json that is a JSON {type(config).__name__}, not an object; "
                               "it is damaged. Re-download the model.")
    for key, most in CONFIG_LIMITS.items():
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise UnsupportedModel(f"'{name}' has a config.json whose {key} is {str(value)[:40]!r}, which no model "
                                   "has; it is damaged. Re-download the model.")


# quantisation formats whose weights SpecChat reads (quantization_config.quant_method)
def check_quantisation(name: str, qc: dict | None) -> None:
    """Refuse, by name, a checkpoint quantised in a format SpecChat does not read."""
    if not qc:
        return
    method = str(qc.get("quant_method", "unknown"))
    ok = {
        "bitsandbytes": bool(qc.get("load_in_4bit")),
        "awq": qc.get("bits", 4) == 4 and str(qc.get("version", "gemm")).lower() == "gemm",
        "gptq": qc.get("bits", 4) == 4,
        "fp8": True, "fbgemm_fp8": True, "mxfp4": True,
        "compressed-tensors": qc.get("format") in ("float-quantized", "naive-quantized"),
    }.get(method, False)
    if not ok:
        detail = {"bitsandbytes": "8-bit bitsandbytes", "awq": f"AWQ {qc.get('bits')}-bit {qc.get('version')}",
                  "gptq": f"GPTQ {qc.get('bits')}-bit", "compressed-tensors": f"compressed-tensors {qc.get('format')}"}
        raise UnsupportedModel(
            f"'{name}' is quantised as {detail.get(method, method)}, a format SpecChat cannot load. It loads "
            "16-bit, FP8, MXFP4 (gpt-oss), bitsandbytes 4-bit (NF4), AWQ (GEMM) and GPTQ 4-bit checkpoints and "
            "GGUF files: download one of those versions of the model.")


def file_head(path: Path, n: int) -> bytes:
    """The first `n` bytes of a regular file. A FIFO, socket or device named as a model is
    refused (UnsupportedModel) without blocking or reading it; OSError passes through."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsupportedModel(f"'{path}' is not a regular file (a named pipe, socket or device): give a model "
                                   "folder or a .gguf file.")
        return os.read(fd, n)
    finally:
        os.close(fd)


def is_gguf(path: Path) -> bool:
    """A regular file that starts like a GGUF (whatever its name)."""
    try:
        return file_head(path, 4) == b"GGUF"
    except (OSError, UnsupportedModel):
        return False


def check_gguf(path: Path) -> None:
    try:
        magic = file_head(path, 4)
    except OSError as exc:
        raise ModelNotFound(f"Cannot read '{path}': {exc.strerror}.") from exc
    if magic != b"GGUF":
        raise UnsupportedModel(f"'{path.name}' is not a GGUF file (bad header); it may be corrupt — re-download it.")


def model_fingerprint(path: Path, quant: str, dtype: torch.dtype, device: str) -> str:
    """What a model's KV cache depends on: its files (resolved path, names, sizes, modification
    times), the quantisation of its layers, the compute dtype and the kind of device. Saved KV
    caches are keyed by it, so a changed file or setting never reuses an old cache."""
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else split_parts(path)
    stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    blob = json.dumps([str(path.resolve()), stats, quant, str(dtype), torch.device(device).type])
    return hashlib.sha256(blob.encode()).hexdigest()


def draft_only(folder: Path) -> str:
    """What `folder` holds when it is a draft head rather than a model ("" when it is not)."""
    if is_eagle_folder(folder):
        return "an EAGLE-3 head"
    return "a Gemma 4 assistant" if is_assistant_folder(folder) else ""


def load_model(
    spec: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    quant: Quant = "none",
    offload: Offload = "none",
    ram_limit_bytes: int | None = None,
    context_length: int | None = None,
    reserve_bytes: int = 0,
    report: Callable[[float, str], None] | None = None,
    experts: Experts = "auto",
) -> LoadedModel:
    """Load one model (see _load_model) and record its fingerprint. On the CPU, PyTorch's
    threads are set to the physical cores first (engine.threads)."""
    if torch.device(device).type == "cpu":
        use_compute_threads()
    else:
        steady_attention()
    loaded = _load_model(spec, device, dtype, quant=quant, offload=offload, ram_limit_bytes=ram_limit_bytes,
                         context_length=context_length, reserve_bytes=reserve_bytes, report=report, experts=experts)
    loaded.model.fingerprint = model_fingerprint(loaded.path, quant, dtype, device)
    return loaded


def _load_model(
    spec: str | Path,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    *,
    quant: Quant = "none",
    offload: Offload = "none",
    ram_limit_bytes: int | None = None,
    context_length: int | None = None,
    reserve_bytes: int = 0,
    report: Callable[[float, str], None] | None = None,
    experts: Experts = "auto",
) -> LoadedModel:
    """Load one model, built on the meta device and filled tensor by tensor (materialise.py):
    resident 16-bit layers as transformers modules, the others packed in the host store: NF4
    when `quant` is "nf4" or the checkpoint is bitsandbytes 4-bit, a GGUF's own blocks, AWQ or
    GPTQ int4 as stored. Packed layers are de-quantised on the device as they run."""
    path = resolve_path(str(spec))
    settings = MaterialiseSettings(device=device, dtype=dtype, quant=quant, offload=offload,
                                   ram_limit_bytes=ram_limit_bytes, context_length=context_length,
                                   reserve_bytes=reserve_bytes, experts=experts)
    try:
        if path.is_dir():
            config_dict = check_folder(path)
            drafter = draft_only(path)
            if drafter:
                raise UnsupportedModel(f"'{path.name}' holds {drafter} that drafts for another model; it cannot chat "
                                       "on its own. Load the model it was made for and pass this folder as its draft "
                                       "(--draft FOLDER, or the Models page's Draft box); kept beside that model, "
                                       "'auto' finds it.")
            tokenizer: Tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
            text = text_config(config_dict, path.name)
            if text is not None:  # the wrapper's text model, with the wrapper's tokenizer
                config_dict, config = text, config_object(text)
            else:
                config = AutoConfig.from_pretrained(path, trust_remote_code=False)
            layer_kinds(config, path.name)  # every field the layer kinds read, checked
            generation = GenerationConfig.from_pretrained(path) if (path / "generation_config.json").is_file() else None
            model = materialise(SafetensorsWeights(path, config_dict), config, settings, report, generation)
            return LoadedModel(model=model, tokenizer=tokenizer, path=path)
        if not path.is_file():  # a FIFO, socket or device: refused before anything opens it
            file_head(path, 0)
        if path.suffix.lower() == ".gguf" or is_gguf(path):  # Ollama's blobs have no suffix
            check_gguf(path)
            weights = GGUFWeights(path)
            try:
                layer_kinds(weights.config, path.name)
                tokenizer = gguf_tokenizer(weights.path)  # the first part of a split model holds it
            except BaseException:
                weights.close()
                raise
            return LoadedModel(model=materialise(weights, weights.config, settings, report), tokenizer=tokenizer,
                               path=path)
        if path.suffix.lower() in (".bin", ".pt", ".pth", ".ckpt"):
            raise UnsupportedModel(f"'{path.name}' is a pickle checkpoint; SpecChat loads only .safetensors "
                                   "folders and .gguf files.")
        raise UnsupportedModel(f"'{path}' is neither a model folder nor a .gguf file.")
    except (EngineError, KeyboardInterrupt):
        raise
    except MissingPart as exc:  # a split model with a part not (yet) there: say which
        raise ModelNotFound(str(exc)) from exc
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(f"Not enough memory to load '{path.name}'. Close other programs, pick a smaller "
                          "model, or use --offload auto / --quant nf4.") from exc
    except (OSError, ValueError, KeyError, RuntimeError, EOFError, IndexError, struct.error, TypeError,
            AttributeError, OverflowError, StrictDataclassError) as exc:
        # a truncated or corrupt file surfaces as any of these from safetensors / gguf readers and from
        # transformers reading a config or tokenizer whose values have the wrong types (its configs are
        # huggingface_hub strict dataclasses, which raise their own validation errors)
        log.debug("load failed", exc_info=True)
        first = str(exc).strip().splitlines()[0][:200].rstrip(".") if str(exc).strip() else type(exc).__name__
        raise UnsupportedModel(f"Could not load '{path.name}': {first}. The files may be corrupt or incomplete; "
                               "re-download the model.") from exc


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Target and draft must share a tokenizer vocabulary (token -> id); their embedding
    matrices may still differ in padding rows."""
    tv = target.tokenizer.get_vocab()
    dv = draft.tokenizer.get_vocab()
    if tv != dv:
        only_t = len(set(tv.items()) - set(dv.items()))
        raise UnsupportedModel(
            f"The draft '{draft.path.name}' does not share the target's tokenizer "
            f"({only_t} of {len(tv)} target tokens differ). Choose a draft from the same model family."
        )


def resolve_device(device: str) -> tuple[Literal["cpu", "cuda"], torch.dtype]:
    """--device value -> (device, compute dtype): bf16 (fp16 without bf16 support) on CUDA,
    fp32 on CPU (CPU matmuls in 16-bit are slow and the tests compare against fp32)."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("PyTorch sees no CUDA GPU here (a CPU-only build of torch, or no driver); "
                             "choose the CPU device.")
    if device == "cuda":
        return "cuda", torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device == "cpu":
        return "cpu", torch.float32
    raise InvalidRequest(f"Unknown device '{device}'; choose auto, cpu or cuda.")
