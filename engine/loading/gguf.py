"""A GGUF file as a model's weights, read in place: its config and tensor names as transformers
maps them, its decoder layers kept in their own blocks, its tokenizer.

The header is read from a memory map (engine/store/gguf_header.py). The config comes from
transformers' table of GGUF keys (GGUF_CONFIG_MAPPING) and the family's own keys and rules,
tensor names from gguf-py's name map as transformers applies it (get_gguf_hf_weights_map) and
llama.cpp's value transforms from transformers' tensor processors, found by running each
processor on row (and expert) numbers (gguf_families.conversion), or from the family's recipes.
Everything that differs by architecture lives in gguf_families.py. What a transform allows:

- a row permutation (Llama's q/k), applied to the rows after de-quantisation, so the blocks
  themselves stay as the file has them;
- a part of a parameter: an MoE layer's fused `mlp.experts.gate_up_proj` (E, 2I, H) is
  llama.cpp's `ffn_gate_exps` and `ffn_up_exps` (E, I, H each; rows [0, I) and [I, 2I) of each
  expert, as transformers' Qwen2MoeTensorProcessor narrows them in). Each stays a tensor of its
  own in the layout (`name#k`, layout.py) and de-quantises into its slice. `ffn_down_exps`
  (E, H, I) and the router `ffn_gate_inp` (E, H) are the parameters as they are;
- a change of a 1-D tensor's values (Gemma's norms, which llama.cpp stores plus one): the
  processor itself is run on the de-quantised values at load (norms are small and dense);
- a recipe (gpt-oss's experts, transposed and interleaved; the hybrids' norms, A_log and
  convolution, gguf_hybrid.py): a parameter built from its tensors' values at load, dense.

Decoder layers keep their bytes as the file stores them: one layout per layer (layout.py, kind
"gguf") whose offsets are the tensors' offsets in the file, so a layer is one span of the file:
copied as it is into RAM or onto the device, or mapped in place for the disk tier. Tensors of
types the store cannot keep packed (gguf_blocks.PACKED; MXFP4) are de-quantised at load by
gguf-py. Embeddings, final norm and head are de-quantised at load, into the compute dtype.

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
from dataclasses import replace
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
from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

from engine import paths
from engine.errors import UnsupportedModel
from engine.loading import gguf_families
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
    gguf_families.check_runnable(header, [*GGUF_CONFIG_MAPPING, *gguf_families.KEY_TABLES])
    arch = header.architecture or ""
    hf_arch = gguf_families.hf_arch(arch)
    # GGUF key -> config field (None: not mapped); transformers' literal table reads as object
    table = {prefix: cast("dict[str, str | None]", GGUF_CONFIG_MAPPING[prefix])
             for prefix in ("general", "tokenizer")}
    own = gguf_families.KEY_TABLES.get(hf_arch) or cast("dict[str, str | None]", GGUF_CONFIG_MAPPING[hf_arch])
    table[arch] = {**own, **gguf_families.EXTRA_KEYS.get(gguf_families.model_type(header), {})}
    config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(hf_arch, {}))
    for key, value in header.metadata.items():
        prefix, _, rest = key.partition(".")
        target = table.get(prefix, {}).get(rest)
        if target not in (None, -1):
            config[target] = value.tolist() if isinstance(value, np.ndarray) else value
    config["model_type"] = gguf_families.model_type(header)
    gguf_families.apply_rules(header, config)
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
                src = gguf_families.tokenizer_source(src, read_model(gguf).architecture)
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
        self._by_name: dict[str, TensorInfo] = {}  # a parameter's tensor, or a part's (`name#k`)
        self._orders: dict[str, tuple[int, ...] | None] = {}
        # a parameter made of several tensors (fused experts): its parts' names and row ranges
        self._parts: dict[str, list[tuple[str, tuple[int, int]]]] = {}
        self._valued: set[str] = set()  # 1-D tensors whose values transformers' processor changes
        self._recipes: dict[str, gguf_families.Recipe] = {}  # parameters built from tensors at load
        self._shapes: dict[str, tuple[int, ...]] = {}  # the parameters of parts or recipes
        self._processor = TensorProcessor()
        # layer -> (part, offset) of its span, for layers laid out as in the file
        self._spans: dict[int, tuple[int, int]] = {}

    # -- names --
    def bind(self, hf: PreTrainedModel) -> None:
        """Map the file's tensor names onto `hf` (a model built from `config`, meta is fine)."""
        arch = self.header.architecture
        gguf_families.hold_as_stored(self.header, hf)  # gpt-oss's experts, so they stay packed
        self._processor = processor = gguf_families.processor_for(self.header, self.config.to_dict())
        names = get_gguf_hf_weights_map(_Names(hf), processor, model_type=arch,
                                        num_layers=self.config.num_hidden_layers)
        params = dict(hf.named_parameters())
        gguf_families.add_names(self.header, self.config.num_hidden_layers, list(params), names)
        self._recipes = gguf_families.recipes(self.header, self.config, list(params))
        built: set[str] = set()  # tensors a recipe reads
        for name, recipe in self._recipes.items():
            for source in recipe.sources:
                if self.header.tensor(source) is None:
                    raise CorruptGGUF(f"{self.path.name} has no tensor {source} (for {name})")
            built.update(recipe.sources)
        shared: dict[tuple[int, ...], tuple[int, ...]] = {}
        parts: dict[str, list[tuple[tuple[int, int], int, TensorInfo]]] = {}
        for name, t, rows in gguf_families.gpt_oss_tensors(self.header, params, self.path.name):
            built.add(t.name)
            if rows is None:
                self._by_name[name], self._orders[name] = t, None
            else:
                parts.setdefault(name, []).append((rows, int(params[name].shape[-2]), t))
        for t in self.header.tensors:
            hf_name = gguf_families.tensor_name(names, t)
            if hf_name is None or t.name in built:
                continue  # e.g. llama.cpp's precomputed rope_freqs: transformers computes its own
            conv = gguf_families.conversion(processor, t, names)
            if conv.part is not None:
                parts.setdefault(hf_name, []).append((conv.part, conv.rows, t))
                continue
            self._by_name[hf_name] = t
            if conv.valued:
                self._valued.add(hf_name)
            self._orders[hf_name] = None if conv.order is None else shared.setdefault(conv.order, conv.order)
        for hf_name, found in parts.items():
            self._bind_parts(hf_name, found, params.get(hf_name))
        for name, p in params.items():
            if name in self._parts or name in self._recipes:
                self._shapes[name] = tuple(p.shape)
                continue
            found_t = self._by_name.get(name)
            if found_t is None and ".experts." in name and self.header.tensor("blk.0.ffn_gate.0.weight") is not None:
                raise UnsupportedModel(f"'{self.path.name}' stores each expert as a tensor of its own (llama.cpp's "
                                       "conversions before 2024-04), which SpecChat does not read; download a newer "
                                       "conversion of the model.")
            if found_t is None and not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                raise CorruptGGUF(f"{self.path.name} has no tensor for {name}")
            if found_t is not None and found_t.shape != tuple(p.shape):
                raise CorruptGGUF(f"{self.path.name}: {found_t.name} is {found_t.shape}, the model needs {tuple(p.shape)}")

    def _bind_parts(self, name: str, found: list[tuple[tuple[int, int], int, TensorInfo]],
                    p: nn.Parameter | None) -> None:
        """A parameter filled by several tensors (fused experts: gate rows, then up rows): they
        must tile its rows exactly, each with the parameter's other dims."""
        found.sort(key=lambda f: f[0])
        if p is None:
            raise CorruptGGUF(f"{self.path.name}: {found[0][2].name} fills {name}, which the model does not have")
        shape = tuple(p.shape)
        at = 0
        for k, ((a, b), rows, t) in enumerate(found):
            want = (*shape[:-2], b - a, shape[-1])
            if a != at or rows != shape[-2] or t.shape != want:
                raise CorruptGGUF(f"{self.path.name}: {t.name} is {t.shape}, rows {a}..{b} of {rows}; the model's "
                                  f"{name} is {shape}")
            self._by_name[f"{name}#{k}"] = t
            self._orders[f"{name}#{k}"] = None
            at = b
        if at != shape[-2]:
            raise CorruptGGUF(f"{self.path.name} has rows 0..{at} of {shape[-2]} of {name}")
        self._parts[name] = [(f"{name}#{k}", r) for k, (r, _, _) in enumerate(found)]

    def has(self, name: str) -> bool:
        return name in self._by_name or name in self._parts or name in self._recipes

    def types(self) -> dict[str, int]:
        """ggml type counts of the decoder layers' matrices and experts, by type name (for messages)."""
        counts: dict[str, int] = {}
        for name, t in self._by_name.items():
            if name.startswith(LAYERS) and len(t.shape) >= 2:
                counts[t.type_name] = counts.get(t.type_name, 0) + 1
        return counts

    # -- tensors --
    def blocks(self, name: str) -> tuple[torch.Tensor, int, tuple[int, ...], torch.Tensor | None] | None:
        """Tensor `name` as the file stores it: (its bytes, a view of the mapping; the ggml type;
        the shape; the row order to undo, or None); None when the file has no such tensor (or
        it is made of parts, or needs a value transform)."""
        t = self._by_name.get(name)
        if t is None or name in self._valued:
            return None
        order = self._orders.get(name)
        return self.raw(t), int(t.qtype), tuple(t.shape), None if order is None else torch.tensor(order)

    def raw(self, t: TensorInfo) -> torch.Tensor:
        return self._bytes[t.part][t.offset:t.offset + t.nbytes]

    def load(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """Tensor `name` de-quantised into `dtype` on `device` (de-quantised where it will live)."""
        shape = self._shapes[name] if name in self._shapes else self._by_name[name].shape
        out = torch.empty(shape, dtype=dtype, device=device)
        self.dequantize_to(name, out)
        return out

    def dequantize_to(self, name: str, out: torch.Tensor) -> None:
        parts = self._parts.get(name)
        if parts is not None:  # each part into its rows of every matrix
            for key, (a, b) in parts:
                self.dequantize_to(key, out.narrow(-2, a, b - a))
            return
        recipe = self._recipes.get(name)
        if recipe is not None:  # built from its tensors' values, in fp32
            self._build(name, recipe, out)
            return
        t = self._by_name[name]
        order = self._orders[name]
        if name in self._valued:  # transformers' processor on the values, in fp32 as it runs it
            dense = torch.empty(t.shape, dtype=torch.float32)
            self._dequantize(t, None, dense)
            out.copy_(torch.from_numpy(np.asarray(self._processor.process(weights=dense.numpy(), name=t.name).weights)))
        else:
            self._dequantize(t, order, out)
        self._drop(t.part, t.offset, t.offset + t.nbytes)

    def _build(self, name: str, recipe: gguf_families.Recipe, out: torch.Tensor) -> None:
        values = []
        for source in recipe.sources:
            t = self.header.tensor(source)
            assert t is not None, "bind checked every source"
            dense = torch.empty(t.shape, dtype=torch.float32)
            self._dequantize(t, None, dense)
            self._drop(t.part, t.offset, t.offset + t.nbytes)
            values.append(dense)
        try:
            value = recipe.build(values)
        except (ValueError, RuntimeError) as exc:
            raise CorruptGGUF(f"{self.path.name}: the tensors of {name} do not fit together ({exc})") from exc
        if tuple(value.shape) != tuple(out.shape):
            raise CorruptGGUF(f"{self.path.name}: {', '.join(recipe.sources)} make {name} of shape "
                              f"{tuple(value.shape)}, the model needs {tuple(out.shape)}")
        out.copy_(value)

    def _dequantize(self, t: TensorInfo, order: tuple[int, ...] | None, out: torch.Tensor) -> None:
        if t.qtype in gguf_blocks.SUPPORTED:
            raw = self.raw(t).to(out.device)
            gguf_blocks.dequantize_into(raw, t.qtype, out, None if order is None else torch.tensor(order, device=out.device))
        else:  # a type only gguf-py decodes: on the CPU, in fp32
            blocks = np.frombuffer(self._maps[t.part], dtype=np.uint8, count=t.nbytes, offset=t.offset)
            dense = torch.from_numpy(gguf_quants.dequantize(blocks, GGMLQuantizationType(t.qtype))).reshape(t.shape)
            out.copy_(dense if order is None else dense[list(order)])

    # -- decoder layers --
    def layouts(self, hf: PreTrainedModel, dtype: torch.dtype, quant: Quant) -> list[LayerLayout]:
        """One layout per decoder layer: the file's own blocks ("gguf"), or NF4 when asked (one
        per kind of layer: a hybrid's linear and attention layers, GLM's dense first layers)."""
        layers = hf.model.layers
        if quant == "nf4":
            seen: dict[tuple, LayerLayout] = {}
            return [seen.setdefault(tuple((n, tuple(p.shape)) for n, p in layer.named_parameters()),
                                    LayerLayout.of(layer, dtype, "nf4")) for layer in layers]
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
            full = f"{LAYERS}{i}.{name}"
            recipe = self._recipes.get(full)
            parts = self._parts.get(full, [(full, None)])
            if recipe is not None:  # built at load from its tensors (which bind found)
                tensors = [t for t in map(self.header.tensor, recipe.sources) if t is not None]
            else:
                tensors = [self._by_name[key] for key, _ in parts]
            infos += tensors
            if recipe is None and all(t.qtype in gguf_blocks.SUPPORTED for t in tensors) and full not in self._valued:
                for (key, rows), t in zip(parts, tensors):
                    entries.append(Entry(name + key[len(full):], "gguf", tuple(p.shape), torch.uint8, t.offset,
                                         t.nbytes, t.qtype, self._orders[key], rows))
            else:  # de-quantised at load (a type only gguf-py reads, values transformers changes, a recipe)
                entries.append(Entry(name, "dense", tuple(p.shape), dtype, 0, p.numel() * esize))
        part = infos[0].part
        start = min(t.offset for t in infos)
        end = max(t.offset + t.nbytes for t in infos)
        inside = np.searchsorted(starts[part], end) - np.searchsorted(starts[part], start)  # tensors starting in the span
        in_file = (all(e.kind == "gguf" and (e.offset - start) % 16 == 0 for e in entries) and inside == len(infos)
                   and all(t.part == part for t in infos))
        if in_file:
            self._spans[i] = (part, start)
            rel = [replace(e, offset=e.offset - start) for e in entries]
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
            if e.kind == "gguf":  # a part's bytes are its tensor's: `name#k` is its key too
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
