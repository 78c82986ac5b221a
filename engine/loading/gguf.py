"""A GGUF file as a model's weights, read in place: its config and tensor names as transformers
maps them, its decoder layers kept in their own blocks, its tokenizer.

The header is read from a memory map (engine/store/gguf_header.py). The config comes from
transformers' table of GGUF keys (GGUF_CONFIG_MAPPING), tensor names from gguf-py's name map as transformers applies
it (get_gguf_hf_weights_map) and llama.cpp's value transforms from transformers' tensor
processors: for the supported architectures a row permutation (Llama's q/k), which is found by
running the processor on row numbers and then applied to the rows after de-quantisation, so the
blocks themselves stay as the file has them.

Decoder layers keep their bytes as the file stores them: one layout per layer (layout.py, kind
"gguf") whose offsets are the tensors' offsets in the file, so a layer is one span of the file:
copied as it is into RAM or onto the device, or mapped in place for the disk tier. Tensors of
types the store cannot keep packed (gguf_blocks.PACKED) are de-quantised at load by gguf-py.
Embeddings, final norm and head are de-quantised at load, into the compute dtype.

The tokenizer is transformers' GGUF tokenizer conversion (seconds for a large vocabulary), run
on the file through a fresh folder that holds nothing else (`isolated`), and kept in the cache
beside nothing but itself, keyed by the file's place, size and modification time.

What this module does not do: place layers (materialise.py) or de-quantise blocks (offload).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import mmap
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants
from torch import nn
from transformers import CONFIG_MAPPING, AutoTokenizer, PretrainedConfig
from transformers.integrations.ggml import (
    GGUF_CONFIG_DEFAULTS_MAPPING,
    GGUF_CONFIG_MAPPING,
)
from transformers.modeling_gguf_pytorch_utils import (
    TENSOR_PROCESSORS,
    TensorProcessor,
    get_gguf_hf_weights_map,
)

from engine import paths
from engine.errors import UnsupportedModel
from engine.offload import gguf_blocks
from engine.offload.layout import Entry, LayerLayout, pack_entry
from engine.store.gguf_header import CorruptGGUF, GGUFHeader, TensorInfo, read_model
from engine.types import Quant

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

LAYERS = "model.layers."


@contextlib.contextmanager
def isolated(gguf: Path) -> Iterator[Path]:
    """The GGUF, reached through a fresh folder that holds nothing else. transformers reads a
    GGUF's folder as well (config.json, tokenizer files, and with an `auto_map` Python code it
    offers to run), so a file is only ever read from where nothing can lie beside it: its own
    metadata is the whole model."""
    with tempfile.TemporaryDirectory(prefix="specchat-gguf-") as tmp:
        link = Path(tmp) / (gguf.name if gguf.suffix.lower() == ".gguf" else gguf.name + ".gguf")  # Ollama blobs
        try:
            link.symlink_to(gguf.resolve())
        except OSError:  # Windows without the symlink privilege: a hard link, else a copy
            try:
                os.link(gguf, link)
            except OSError:
                shutil.copy2(gguf, link)
        yield link


def gguf_config(header: GGUFHeader) -> PretrainedConfig:
    """The transformers config of a GGUF, from its metadata through transformers' own table."""
    arch = header.architecture
    if arch not in GGUF_CONFIG_MAPPING:
        raise UnsupportedModel(f"'{header.path.name}' is a '{arch or 'unknown'}' GGUF, an architecture "
                               "transformers cannot map; SpecChat runs GGUF files of llama, mistral, qwen2 and qwen3 models.")
    # GGUF key -> config field (None: not mapped); transformers' literal table reads as object
    table = {prefix: cast("dict[str, str | None]", GGUF_CONFIG_MAPPING[prefix])
             for prefix in ("general", "tokenizer", arch)}
    config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(arch, {}))
    for key, value in header.metadata.items():
        prefix, _, rest = key.partition(".")
        target = table.get(prefix, {}).get(rest)
        if target not in (None, -1):
            config[target] = value.tolist() if isinstance(value, np.ndarray) else value
    # as transformers decides it: a file without an output matrix ties the head to the embeddings
    config["tie_word_embeddings"] = header.tensor("output.weight") is None
    if "vocab_size" not in config and isinstance(header.metadata.get("tokenizer.ggml.tokens"), int):
        config["vocab_size"] = header.metadata["tokenizer.ggml.tokens"]
    try:
        return CONFIG_MAPPING[config["model_type"]].from_dict(config)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptGGUF(f"{header.path.name} has an incomplete model description ({exc})") from exc


def gguf_tokenizer(gguf: Path, cache_dir: Path | None = None) -> PreTrainedTokenizerBase:
    """transformers' tokenizer for a GGUF, converted once and then read from the cache."""
    root = (cache_dir or paths.cache_dir()) / "gguf"
    folder = root / cache_key(gguf)
    if not (folder / "tokenizer_config.json").is_file():
        for stale in root.glob(cache_key(gguf).rsplit("-", 2)[0] + "-*") if root.is_dir() else ():
            if stale != folder:  # an older version of this file
                shutil.rmtree(stale, ignore_errors=True)

        def build(tmp: Path) -> None:
            with isolated(gguf) as src:
                tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name, trust_remote_code=False)
            tok.save_pretrained(tmp)

        log.info("converting the tokenizer of %s (once)", gguf.name)
        paths.publish_folder(folder, build)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)


def cache_key(gguf: Path) -> str:
    """Cache folder name of a GGUF: its name, where it is, its size and modification time."""
    stat = gguf.stat()
    where = hashlib.sha1(str(gguf.resolve()).encode()).hexdigest()[:10]  # same name, another folder
    return f"{gguf.stem}-{where}-{stat.st_size}-{stat.st_mtime_ns}"


class GGUFWeights:
    """The tensors of a GGUF model by their transformers names (after `bind`), read in place from
    its file, or from every file of a model split into parts (a tensor lies whole in one part)."""

    def __init__(self, path: Path) -> None:
        self.header = read_model(path)
        self.path = self.header.path  # the first part of a split model, whichever part was named
        self.config = gguf_config(self.header)
        self._files: list[Any] = []
        self._maps: list[mmap.mmap] = []
        self._bytes: list[torch.Tensor] = []
        try:
            for file in self.header.files:
                self._files.append(open(file, "rb"))  # noqa: SIM115 -- kept open with the mapping
                self._maps.append(mmap.mmap(self._files[-1].fileno(), 0, access=mmap.ACCESS_READ))
                with warnings.catch_warnings():  # a read-only mapping: only ever read from
                    warnings.simplefilter("ignore", UserWarning)
                    self._bytes.append(torch.frombuffer(self._maps[-1], dtype=torch.uint8))
        except BaseException:
            self.close()
            raise
        self._by_name: dict[str, TensorInfo] = {}
        self._orders: dict[str, tuple[int, ...] | None] = {}
        # layer -> (part, offset) of its span, for layers laid out as in the file
        self._spans: dict[int, tuple[int, int]] = {}

    # -- names --
    def bind(self, hf: PreTrainedModel) -> None:
        """Map the file's tensor names onto `hf` (a model built from `config`, meta is fine)."""
        arch = self.header.architecture
        processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=self.config.to_dict())
        names = get_gguf_hf_weights_map(_Names(hf), processor, model_type=arch,
                                        num_layers=self.config.num_hidden_layers)
        shared: dict[tuple[int, ...], tuple[int, ...]] = {}
        for t in self.header.tensors:
            hf_name = names.get(t.name)
            if hf_name is None:
                continue  # e.g. llama.cpp's precomputed rope_freqs: transformers computes its own
            self._by_name[hf_name] = t
            order = _row_order(processor, t, names)
            self._orders[hf_name] = None if order is None else shared.setdefault(order, order)
        for name, p in list(hf.named_parameters()):
            found = self._by_name.get(name)
            if found is None and not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                raise CorruptGGUF(f"{self.path.name} has no tensor for {name}")
            if found is not None and found.shape != tuple(p.shape):
                raise CorruptGGUF(f"{self.path.name}: {found.name} is {found.shape}, the model needs {tuple(p.shape)}")

    def has(self, name: str) -> bool:
        return name in self._by_name

    def types(self) -> dict[str, int]:
        """ggml type counts of the decoder layers' tensors, by type name (for messages)."""
        counts: dict[str, int] = {}
        for name, t in self._by_name.items():
            if name.startswith(LAYERS) and len(t.shape) == 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    # -- tensors --
    def blocks(self, name: str) -> tuple[torch.Tensor, int, tuple[int, ...], torch.Tensor | None] | None:
        """Tensor `name` as the file stores it: (its bytes, a view of the mapping; the ggml type;
        the shape; the row order to undo, or None); None when the file has no such tensor."""
        t = self._by_name.get(name)
        if t is None:
            return None
        order = self._orders.get(name)
        return self.raw(t), int(t.qtype), tuple(t.shape), None if order is None else torch.tensor(order)

    def raw(self, t: TensorInfo) -> torch.Tensor:
        return self._bytes[t.part][t.offset:t.offset + t.nbytes]

    def load(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Tensor `name` de-quantised into `dtype` on `device` (de-quantised where it will live)."""
        t = self._by_name[name]
        out = torch.empty(t.shape, dtype=dtype, device=device)
        self.dequantize_to(name, out)
        return out

    def dequantize_to(self, name: str, out: torch.Tensor) -> None:
        t = self._by_name[name]
        order = self._orders[name]
        if t.qtype in gguf_blocks.SUPPORTED:
            raw = self.raw(t).to(out.device)
            gguf_blocks.dequantize_into(raw, t.qtype, out, None if order is None else torch.tensor(order, device=out.device))
        else:  # a type only gguf-py decodes: on the CPU, in fp32
            blocks = np.frombuffer(self._maps[t.part], dtype=np.uint8, count=t.nbytes, offset=t.offset)
            dense = torch.from_numpy(gguf_quants.dequantize(blocks, GGMLQuantizationType(t.qtype))).reshape(t.shape)
            out.copy_(dense if order is None else dense[list(order)])
        self._drop(t.part, t.offset, t.offset + t.nbytes)

    # -- decoder layers --
    def layouts(self, hf: PreTrainedModel, dtype: torch.dtype, quant: Quant) -> list[LayerLayout]:
        """One layout per decoder layer: the file's own blocks ("gguf"), or NF4 when asked."""
        layers = hf.model.layers
        if quant == "nf4":
            layout = LayerLayout.of(layers[0], dtype, "nf4")
            return [layout] * len(layers)
        starts: dict[int, list[int]] = {}
        for t in self.header.tensors:
            starts.setdefault(t.part, []).append(t.offset)
        for offsets in starts.values():
            offsets.sort()
        return [self._layer_layout(i, layer, dtype, starts) for i, layer in enumerate(layers)]

    def _layer_layout(self, i: int, layer: nn.Module, dtype: torch.dtype, starts: dict[int, list[int]]) -> LayerLayout:
        esize = torch.empty((), dtype=dtype).element_size()
        entries: list[Entry] = []
        infos = []
        for name, p in layer.named_parameters():
            t = self._by_name[f"{LAYERS}{i}.{name}"]
            infos.append(t)
            if t.qtype in gguf_blocks.SUPPORTED:
                entries.append(Entry(name, "gguf", t.shape, torch.uint8, t.offset, t.nbytes, t.qtype,
                                     self._orders[f"{LAYERS}{i}.{name}"]))
            else:
                entries.append(Entry(name, "dense", t.shape, dtype, 0, p.numel() * esize))
        part = infos[0].part
        start = min(t.offset for t in infos)
        end = max(t.offset + t.nbytes for t in infos)
        inside = np.searchsorted(starts[part], end) - np.searchsorted(starts[part], start)  # tensors starting in the span
        in_file = (all(e.kind == "gguf" and (e.offset - start) % 16 == 0 for e in entries) and inside == len(infos)
                   and all(t.part == part for t in infos))
        if in_file:
            self._spans[i] = (part, start)
            rel = [Entry(e.name, e.kind, e.shape, e.dtype, e.offset - start, e.nbytes, e.qtype, e.row_order)
                   for e in entries]
            return LayerLayout.packed(rel, dtype, "gguf", span=end - start)
        return LayerLayout.packed(entries, dtype, "gguf")  # our own offsets: packed tensor by tensor

    def pack_layer(self, i: int, layout: LayerLayout, buf: torch.Tensor, work: torch.device) -> None:
        """Layer i into `buf` (host or device) in `layout`."""
        prefix = f"{LAYERS}{i}."
        if layout.quant == "gguf" and i in self._spans:  # one span of the file, as it is
            part, start = self._spans[i]
            buf[:layout.nbytes].copy_(self._bytes[part][start:start + layout.nbytes])
            self._drop(part, start, start + layout.nbytes)
            return
        for e in layout.entries:
            if e.kind == "gguf":
                layout.view(buf, e).copy_(self.raw(self._by_name[prefix + e.name]))
            elif e.kind == "nf4":
                pack_entry(layout, buf, e.name, self.load(prefix + e.name, layout.compute_dtype, work))
            elif not e.side:
                self.dequantize_to(prefix + e.name, layout.view(buf, e))

    def mapped(self, layers: Sequence[int], layouts: Sequence[LayerLayout]) -> tuple[Path, list[int]] | None:
        """(the file, each layer's offset) when these layers are spans of one file: the disk tier
        then reads them from the file itself, no second copy on disk. (Disk layers of a split
        model that lie in two parts are copied to the disk tier's own file instead.)"""
        if not all(layouts[i].quant == "gguf" and i in self._spans for i in layers):
            return None
        parts = {self._spans[i][0] for i in layers}
        if len(parts) != 1:
            log.info("the disk tier's layers lie in %d parts of %s: copied to one file", len(parts), self.path.name)
            return None
        return self.header.files[parts.pop()], [self._spans[i][1] for i in layers]

    def cache_files(self) -> list[Path]:
        return list(self.header.files)

    def _drop(self, part: int, lo: int, hi: int) -> None:
        """Drop pages just read from this process (the OS may keep them cached)."""
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if sys.platform != "win32" and advice is not None and hasattr(self._maps[part], "madvise"):
            start = lo // mmap.PAGESIZE * mmap.PAGESIZE
            self._maps[part].madvise(advice, start, hi - start)

    def close(self) -> None:
        self._bytes = []
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a tensor view is still alive; the mapping goes with it
                pass
        for f in self._files:
            f.close()


class _Names:
    """What get_gguf_hf_weights_map reads of a model: its tensor names, and no submodules. (On a
    real model it recurses into every submodule and builds gguf-py's name table for each: a
    minute for 80 layers. The names of our architectures all map from the top.)"""

    def __init__(self, hf: PreTrainedModel) -> None:
        self.config = hf.config
        self._names = [n for n, _ in hf.named_parameters(remove_duplicate=False)]

    def state_dict(self) -> dict[str, None]:
        return dict.fromkeys(self._names)

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return iter(())


def _row_order(processor: TensorProcessor, t: TensorInfo, names: dict[str, str]) -> tuple[int, ...] | None:
    """The row permutation transformers' processor applies to tensor t (None: none), found by
    processing row numbers. Any other transform cannot be applied to packed blocks: refused."""
    rows = t.shape[0]
    probe = np.arange(rows, dtype=np.int64).reshape(rows, *([1] if len(t.shape) > 1 else []))
    out = processor.process(weights=probe, name=t.name, tensor_key_mapping=names, parsed_parameters={"tensors": {}})
    got = None if out.weights is None else np.asarray(out.weights).reshape(-1)
    if out.name != t.name or got is None or got.shape != (rows,) or sorted(got.tolist()) != list(range(rows)):
        raise UnsupportedModel(f"The GGUF tensor {t.name} needs a conversion SpecChat cannot apply to packed "
                               "weights; this architecture is not supported.")
    if len(t.shape) == 1:
        if not np.array_equal(got, probe.reshape(-1)):
            raise UnsupportedModel(f"The GGUF tensor {t.name} needs a conversion SpecChat does not apply.")
        return None
    return None if np.array_equal(got, np.arange(rows)) else tuple(int(x) for x in got)
