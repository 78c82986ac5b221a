"""The peer benchmark's own parts (the benchmark itself builds llama.cpp and never runs here):
reading llama.cpp's timing line, the table's ratios, and the Q8_0 rewrite of a GGUF that it
compares on."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader

from engine.cli.bench_peer import _EVAL, Row, format_rows
from engine.loading.load import load_model
from engine.testing.gguf_write import requantize_gguf
from engine.testing.synthetic import tiny_gguf

STDERR = """\
0.00.718.292 I common_perf_print: prompt eval time =      18.84 ms /     4 tokens (    4.71 ms per token,   212.33 tokens per second)
0.00.718.293 I common_perf_print:        eval time =     285.25 ms /    31 runs   (    9.20 ms per token,   108.68 tokens per second)
"""


def test_the_decode_line_is_read_not_the_prompt_line() -> None:
    found = _EVAL.search(STDERR)
    assert found is not None and (float(found.group(1)), int(found.group(2))) == (285.25, 31)


def test_ratios_are_against_llama_cpp_on_the_same_prompts_and_model() -> None:
    rows = [Row("a", "llama.cpp llama-bench (empty context)", 120.0), Row("a", "llama.cpp on the prompts", 100.0),
            Row("a", "SpecChat plain decoding", 40.0, 1.0), Row("b", "SpecChat plain decoding", 10.0, 1.0)]
    table = format_rows(rows, 2, 64, "edit.txt", 8).splitlines()
    assert table[-2].rstrip().endswith("0.40x")
    assert not table[-1].rstrip().endswith("x")  # no peer row for model b: no ratio
    assert not table[-3].rstrip().endswith("x") and not table[-4].rstrip().endswith("x")


def test_prompt_speed_is_against_llama_bench_on_the_same_model() -> None:
    rows = [Row("a", "llama.cpp llama-bench (empty context)", 120.0, prompt_tps=200.0),
            Row("a", "llama.cpp on the prompts", 100.0), Row("a", "SpecChat plain decoding", 90.0, 1.0, prompt_tps=150.0),
            Row("b", "SpecChat plain decoding", 10.0, 1.0, prompt_tps=50.0)]
    table = format_rows(rows, 2, 64, "edit.txt", 8).splitlines()
    assert table[-2].split()[-3:] == ["0.90x", "150.0", "0.75x"]
    assert table[-1].split()[-1] == "50.0"  # no llama.cpp figure for model b: no ratio
    assert table[-4].split()[-1] == "200.0"  # llama.cpp's own row: its figure, no ratio


def test_a_gguf_rewritten_as_q8_0_keeps_its_metadata_and_loads(model_cache: Path, tmp_path: Path) -> None:
    src = tiny_gguf("llama", layers=2, layer_types=("Q4_0",), cache_dir=model_cache)
    dest = requantize_gguf(src, tmp_path / "out" / "m-q8_0.gguf", Q.Q8_0)
    before, after = GGUFReader(src), GGUFReader(dest)
    assert [t.name for t in after.tensors] == [t.name for t in before.tensors]
    for old, new in zip(before.tensors, after.tensors):
        floats = old.tensor_type in (Q.F32, Q.F16)
        assert new.tensor_type == (old.tensor_type if floats else Q.Q8_0), new.name
    kept = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "llama.block_count", "tokenizer.chat_template")
    for key in kept:
        if key in before.fields:
            assert after.fields[key].contents() == before.fields[key].contents(), key
    assert after.fields["general.file_type"].contents() == 7
    assert not dest.with_name(dest.name + ".part").exists()
    assert requantize_gguf(src, dest, Q.Q8_0) == dest  # idempotent
    m = load_model(dest)
    assert m.model.placement is not None and m.model.placement.quant == "gguf"
