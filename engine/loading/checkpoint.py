"""Read a safetensors checkpoint one tensor at a time, without holding it in RAM.

Each shard is memory-mapped; a tensor is copied out of the mapping (converted to the dtype the
caller asks for) and its pages are then dropped from this process with MADV_DONTNEED, so the
resident set grows by the tensors the caller keeps, never by the checkpoint. The format is
the documented one: an 8-byte little-endian header length, a JSON header of
{name: {dtype, shape, data_offsets}}, then the data. The header is read and checked by
engine.store.safetensors_header (regular files only, bounded, every tensor within the file),
which the model store also runs at import.

Checkpoints saved by bitsandbytes in 4-bit (Hugging Face repos named *-bnb-4bit) keep each
quantised Linear weight as packed uint8 codes plus `<name>.absmax`, `.quant_map`, optional
nested (double-quantised) absmax and a packed `quant_state.bitsandbytes__nf4` record.
`nf4(name)` returns such a weight as packed codes + fp32 absmax without de-quantising it.

FP8 weights (E4M3, E5M2) are de-quantised as they load, with their `<name>_scale` (per tensor
or per output channel) or `<name>_scale_inv` (per block, DeepSeek-style) when there is one.
gpt-oss's MXFP4 experts (`<name>_blocks` + `<name>_scales`, mxfp4.py) are served as the tensor
`<name>`, de-quantised one expert at a time into the caller's buffer.
Any other stored dtype is refused by name (UnsupportedModel), never reported as corruption.

What this module does not do: decide where tensors go (materialise.py) or read pickle files.
"""

from __future__ import annotations

import mmap
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import UnsupportedModel
from engine.loading.mxfp4 import dequantize_mxfp4, mxfp4_shape
from engine.store.safetensors_header import CorruptCheckpoint, open_shard, read_shard_header

if TYPE_CHECKING:  # bitsandbytes is imported only when a 4-bit checkpoint needs it
    from bitsandbytes.functional import QuantState

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_QS_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map",
                ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")


class _Shard:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open_shard(path)  # kept open with the mapping
        try:
            size = os.fstat(self._file.fileno()).st_size
            header, self.base = read_shard_header(self._file, path.name, size)
        except BaseException:
            self._file.close()
            raise
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            if info.get("dtype") not in DTYPES:
                raise UnsupportedModel(
                    f"'{path.name}' stores tensor {name} as {info.get('dtype')!r}, a format SpecChat cannot load "
                    "(it loads 16- and 32-bit floats, FP8, bitsandbytes 4-bit, AWQ and GPTQ 4-bit). Pick "
                    "another version of the model, e.g. its GGUF or AWQ release.")
            start, end = info["data_offsets"]
            if self.base + end > size:
                raise CorruptCheckpoint(f"{path.name} is truncated (tensor {name} runs past the end)")
            self.entries[name] = (DTYPES[info["dtype"]], tuple(info["shape"]), start, end)
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ) if size > 0 else None

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, _, _ = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        self.copy_to(name, out)
        return out

    def read_part(self, name: str, i: int) -> torch.Tensor:
        """Slice i along dim 0 of tensor `name` (one expert of a stacked tensor), read alone."""
        dtype, shape, start, end = self.entries[name]
        step = (end - start) // shape[0]
        out = torch.empty(shape[1:], dtype=dtype)
        self._copy_range(start + i * step, start + (i + 1) * step, dtype, shape[1:], out)
        return out

    def copy_to(self, name: str, out: torch.Tensor) -> None:
        """Copy tensor `name` into `out` (any dtype or device: converted by the copy itself, so
        no second full-size temporary), then drop its pages from this process."""
        dtype, shape, start, end = self.entries[name]
        self._copy_range(start, end, dtype, shape, out)

    def _copy_range(self, start: int, end: int, dtype: torch.dtype, shape: tuple[int, ...],
                    out: torch.Tensor) -> None:
        if end == start:
            return
        assert self._map is not None
        lo, hi = self.base + start, self.base + end
        with warnings.catch_warnings():  # a read-only mapping: only ever read from
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=hi - lo, offset=lo)
        try:
            src = raw.view(dtype).reshape(shape)
        except RuntimeError:  # data not aligned to its dtype in the file: go through a copy
            src = raw.clone().view(dtype).reshape(shape)
        out.copy_(src)
        del raw, src
        self._drop(lo, hi)

    def _drop(self, lo: int, hi: int) -> None:
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is None or self._map is None or not hasattr(self._map, "madvise"):
            return
        page = mmap.PAGESIZE
        start = lo // page * page
        self._map.madvise(advice, start, hi - start)

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
        self._file.close()


class Checkpoint:
    """All *.safetensors shards of a folder, addressed by tensor name."""

    def __init__(self, folder: Path, config: dict) -> None:
        files = sorted(folder.glob("*.safetensors"))
        self._shards = [_Shard(f) for f in files]
        self._where: dict[str, _Shard] = {}
        for shard in self._shards:
            for name in shard.entries:
                self._where[name] = shard
        qc = config.get("quantization_config") or {}
        self.bnb_4bit = qc.get("quant_method") == "bitsandbytes" and bool(qc.get("load_in_4bit"))
        block = qc.get("weight_block_size")  # FP8 per-block scales: (rows, columns) each scale covers
        self.fp8_block: tuple[int, int] | None = (
            (block[0], block[1]) if isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block) else None)
        # tensors the model has that the checkpoint stores in parts: name -> one row of stored
        # tensors per slice of dim 0, each row concatenated along its dim 0 (an MoE layer's
        # experts, stored one by one, that transformers' modules hold as one fused tensor)
        self._virtual: dict[str, list[list[str]]] = {}
        self._renamed: dict[str, str] = {}  # model name -> the stored name of the same tensor
        self._mxfp4: dict[str, tuple[str, str]] = {}  # model name -> its stored (blocks, scales)

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def has(self, name: str) -> bool:
        return name in self._where or self._computed(name)

    def _computed(self, name: str) -> bool:
        """Whether `name` is put together from other stored tensors (not read as it is)."""
        return name in self._virtual or name in self._mxfp4

    def stored_names(self) -> list[str]:
        """The names the shards store their tensors under (no aliases)."""
        return [n for s in self._shards for n in s.entries]

    def add_renamed(self, name: str, stored: str) -> bool:
        """Serve the tensor known as `stored` as `name` too (False when there is none)."""
        if stored not in self._where:
            return False
        self._where[name] = self._where[stored]
        self._renamed[name] = self._renamed.get(stored, stored)
        return True

    def add_prefix(self, stored: str, model: str) -> int:
        """Serve every stored tensor named `stored` + rest as `model` + rest too, scales and
        quantisation side tensors included (a vision-language wrapper's decoder under its text
        model's names); names already known are left alone. The count added."""
        added = 0
        for name in self.stored_names():
            if name.startswith(stored) and (alias := model + name[len(stored):]) not in self._where:
                added += self.add_renamed(alias, name)
        return added

    def add_virtual(self, name: str, rows: list[list[str]]) -> bool:
        """Serve `name` as stack(cat(row) for row in rows) when every part is stored and the
        parts of a row agree in everything but dim 0; False (nothing added) otherwise."""
        if not rows or not all(rows) or not all(p in self._where for row in rows for p in row):
            return False
        first = [self.shape(p) for p in rows[0]]
        for row in rows:
            shapes = [self.shape(p) for p in row]
            if shapes != first or any(s[1:] != first[0][1:] for s in shapes):
                return False
        self._virtual[name] = rows
        return True

    def add_mxfp4(self, name: str) -> bool:
        """Serve `name` from its MXFP4 `<name>_blocks` and `<name>_scales` (mxfp4.py) when both
        are stored; False otherwise. UnsupportedModel for MXFP4 outside an MoE layer's experts,
        CorruptCheckpoint when the two are no MXFP4 pair."""
        blocks, scales = f"{name}_blocks", f"{name}_scales"
        if blocks not in self._where or scales not in self._where:
            return False
        if len(self.shape(blocks)) != 4:
            raise UnsupportedModel(f"This checkpoint stores {name} in MXFP4; SpecChat reads MXFP4 only for the "
                                   "experts of an MoE layer (gpt-oss). Pick the model's 16-bit or GGUF release.")
        if (self.dtype(blocks), self.dtype(scales)) != (torch.uint8, torch.uint8) or \
                mxfp4_shape(self.shape(blocks), self.shape(scales)) is None:
            raise CorruptCheckpoint(f"the MXFP4 tensors {blocks} {list(self.shape(blocks))} and {scales} "
                                    f"{list(self.shape(scales))} do not fit together")
        self._mxfp4[name] = (blocks, scales)
        return True

    def _mxfp4_into(self, name: str, out: torch.Tensor) -> None:
        """De-quantise an MXFP4 tensor into `out` (its shape, any dtype or device) one expert at a
        time: the temporaries are one expert's, never the layer's."""
        blocks, scales = self._mxfp4[name]
        for e in range(out.shape[0]):
            out[e].copy_(dequantize_mxfp4(self._read_part(blocks, e), self._read_part(scales, e)))

    def is_mxfp4(self, name: str) -> bool:
        return name in self._mxfp4

    def mxfp4_as_ggml(self, name: str, out: torch.Tensor) -> None:
        """An MXFP4 tensor's blocks rewritten as ggml's MXFP4 blocks into `out` (uint8, experts x
        rows x groups x 17 bytes, any device), one expert at a time: per group of 32 the same
        exponent byte (2^(e - 127) times an E2M1 value is ggml's 2^(e - 128) times it doubled),
        then 16 bytes of which byte j holds value j's code in its low nibble and value j + 16's
        in its high one (the checkpoint's byte j holds values 2j and 2j + 1). No value changes."""
        blocks, scales = self._mxfp4[name]
        view = out.view(self.shape(blocks)[0], -1, 17)
        for e in range(view.shape[0]):
            b = self._read_part(blocks, e).reshape(-1, 16)
            codes = torch.stack((b & 0x0F, b >> 4), dim=-1).reshape(-1, 32)  # value order
            packed = codes[:, :16] | (codes[:, 16:] << 4)
            view[e].copy_(torch.cat((self._read_part(scales, e).reshape(-1, 1), packed), dim=1))

    def _read_part(self, name: str, i: int) -> torch.Tensor:
        return self._shard(name).read_part(self._renamed.get(name, name), i)

    def _assemble(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The fused tensor, each part read straight into its place (one copy of it at most)."""
        out = torch.empty(self.shape(name), dtype=dtype)
        if name in self._mxfp4:
            self._mxfp4_into(name, out)
            return out
        for e, row in enumerate(self._virtual[name]):
            start = 0
            for part in row:
                rows = self.shape(part)[0]
                self.copy_to(part, out[e, start : start + rows])
                start += rows
        return out

    def nbytes(self) -> int:
        return sum(e[3] - e[2] for s in self._shards for e in s.entries.values())

    def _shard(self, name: str) -> _Shard:
        try:
            return self._where[name]
        except KeyError:
            raise CorruptCheckpoint(f"the checkpoint has no tensor '{name}'") from None

    def read(self, name: str) -> torch.Tensor:
        """The stored tensor as it is (CPU, stored dtype; an assembled one in `dtype(name)`)."""
        if self._computed(name):
            return self._assemble(name, self.dtype(name))
        return self._shard(name).read(self._renamed.get(name, name))

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._mxfp4:
            shape = mxfp4_shape(*(self.shape(part) for part in self._mxfp4[name]))
            assert shape is not None, "checked by add_mxfp4"
            return shape
        if name in self._virtual:
            rows = self._virtual[name]
            parts = [self.shape(p) for p in rows[0]]
            return (len(rows), sum(s[0] for s in parts), *parts[0][1:])
        return self._shard(name).entries[self._renamed.get(name, name)][1]

    def dtype(self, name: str) -> torch.dtype:
        if name in self._mxfp4:
            return torch.bfloat16  # holds every MXFP4 value exactly
        if name in self._virtual:
            return self.dtype(self._virtual[name][0][0])
        return self._shard(name).entries[self._renamed.get(name, name)][0]

    def load(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """The tensor in `dtype` on `device`, read straight into its final buffer (4-bit and
        FP8 weights are de-quantised first)."""
        if name in self._mxfp4:
            out = torch.empty(self.shape(name), dtype=dtype, device=device)
            self._mxfp4_into(name, out)
            return out
        if name in self._virtual or self.is_nf4(name) or self.dtype(name) in FP8:
            return self.dense(name, dtype).to(device)
        out = torch.empty(self.shape(name), dtype=dtype, device=device)
        self._shard(name).copy_to(self._renamed.get(name, name), out)
        return out

    def copy_to(self, name: str, out: torch.Tensor) -> None:
        """Tensor `name` into an existing tensor of its shape (any dtype/device)."""
        if name in self._mxfp4:
            self._mxfp4_into(name, out.view(self.shape(name)))
        elif name in self._virtual or self.is_nf4(name) or self.dtype(name) in FP8:
            out.copy_(self.dense(name, out.dtype).reshape(out.shape))
        else:
            self._shard(name).copy_to(self._renamed.get(name, name), out)

    def is_nf4(self, name: str) -> bool:
        """Whether `name` is a bitsandbytes 4-bit weight (packed codes + quant state)."""
        return self.bnb_4bit and f"{name}.absmax" in self._where

    def _quant_state(self, name: str) -> QuantState:
        import bitsandbytes.functional as bnbf

        parts = {s.lstrip("."): self.read(name + s) for s in _QS_SUFFIXES if name + s in self._where}
        return bnbf.QuantState.from_dict(parts, device=torch.device("cpu"))

    def nf4(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A 4-bit weight as (packed codes, fp32 absmax) when it is NF4 with blocksize 64 (what
        the store keeps); None when it needs de-quantising (other block sizes, FP4)."""
        import bitsandbytes.functional as bnbf

        state = self._quant_state(name)
        if state.quant_type != "nf4" or state.blocksize != 64:
            return None
        absmax = state.absmax
        if state.nested:  # double quantisation: the absmax are themselves 8-bit blockwise codes
            absmax = bnbf.dequantize_blockwise(absmax, state.state2) + state.offset
        return self.read(name).reshape(-1, 1), absmax.float()

    def dense(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The tensor in `dtype`, de-quantising a 4-bit or FP8 weight if need be."""
        if self._computed(name):
            return self._assemble(name, dtype)
        if self.is_nf4(name):
            import bitsandbytes.functional as bnbf

            state = self._quant_state(name)
            shape = state.shape  # de-quantised flat: see engine.offload.layout.dequantize_nf4
            state.shape = torch.Size([shape.numel()])
            return bnbf.dequantize_4bit(self.read(name), state).reshape(shape).to(dtype)
        if self.dtype(name) in FP8:
            return self._fp8(name).to(dtype)
        return self.load(name, dtype)

    def _fp8(self, name: str) -> torch.Tensor:
        """An FP8 weight times its scale, in fp32."""
        w = self.read(name).float()
        scale_name = next((name + s for s in ("_scale", "_scale_inv") if name + s in self._where), None)
        if scale_name is None:
            return w
        scale = self.read(scale_name).float()
        if scale.numel() == 1 or w.ndim < 2:
            return w * scale.reshape(-1)[0] if scale.numel() == 1 else w * scale.reshape(w.shape)
        rows, cols = w.shape
        if tuple(scale.shape) in ((rows,), (rows, 1)):  # per output channel
            return w * scale.reshape(rows, 1)
        if scale.ndim != 2:
            raise CorruptCheckpoint(f"the FP8 scale {scale_name} {list(scale.shape)} fits no block grid of "
                                    f"{name} {[rows, cols]}")
        # per block, the last ones of a row or column possibly short: the checkpoint's block size
        # when its grid is the scales' (a 576-row weight in 128-row blocks has 5 scale rows), else
        # the size that many scales cover
        bo, bi = self.fp8_block or (0, 0)
        if (-(-rows // bo) if bo else -1, -(-cols // bi) if bi else -1) != tuple(scale.shape):
            bo, bi = -(-rows // scale.shape[0]), -(-cols // scale.shape[1])
        full = scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:rows, :cols]
        return w * full

    def close(self) -> None:
        for s in self._shards:
            s.close()
