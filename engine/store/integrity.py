"""Whether a model's files are whole, judged from their headers and sizes, without reading
the weights: run at import (a damaged model is refused) and by listings (it is marked).

- A GGUF (and every part of a split one): its header parses within gguf_header's bounds, and
  the file is long enough for every tensor the header declares, at its aligned offset. A GGUF
  cut to 3 MB by a broken download is refused here, naming the tensor that runs past the end.
- A Hugging Face folder: every *.safetensors shard has a whole header whose tensors lie within
  the file (safetensors_header), and every shard model.safetensors.index.json names is there.

What this module does not do: check that the numbers in the weights make sense (no checksum is
known for an import), or load anything.
"""

from __future__ import annotations

from pathlib import Path

from engine.errors import MalformedInput, UnsupportedModel
from engine.store.gguf_header import CorruptGGUF, read_model
from engine.store.safetensors_header import CorruptCheckpoint, check_shard
from engine.untrusted import read_json_file

MAX_INDEX_BYTES = 64 << 20  # a weight map of a 100k-tensor model is a few MiB


def model_damage(path: Path) -> str:
    """Why the model at `path` (a .gguf or a Hugging Face folder) is damaged, in one sentence
    without a final full stop; "" when its headers and sizes add up."""
    try:
        if path.is_dir():
            _check_folder(path)
        else:
            read_model(path)
    except (CorruptGGUF, CorruptCheckpoint) as exc:  # MissingPart too: a part not beside the others
        return str(exc).rstrip(".")
    except MalformedInput as exc:
        return exc.user_message.rstrip(".")
    except OSError as exc:
        return f"{exc.filename or path} cannot be read ({exc.strerror or exc})"
    return ""


def check_model_files(path: Path) -> None:
    """UnsupportedModel saying what is damaged and what to do, unless model_damage(path) is ""."""
    why = model_damage(path)
    if why:
        raise UnsupportedModel(f"{path.name} is damaged: {why}. It may be an interrupted download: download "
                               "it again, then import it.")


def _check_folder(folder: Path) -> None:
    shards = sorted(p for p in folder.glob("*.safetensors"))
    for shard in shards:
        check_shard(shard)
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return
    data = read_json_file(index, what="The safetensors index", max_bytes=MAX_INDEX_BYTES)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CorruptCheckpoint(f"{index.name} has no weight map of tensor names to shard files")
    names = {p.name for p in shards}
    missing = sorted(set(weight_map.values()) - names)
    if missing:
        raise CorruptCheckpoint(f"{index.name} names {', '.join(repr(m[:80]) for m in missing[:3])}"
                                f"{' ...' if len(missing) > 3 else ''}, not in {folder}")
