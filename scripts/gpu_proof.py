"""The GPU proof, from a checkout: the gpu-marked tests, the installer's check and `specchat
bench gpu`, in one report (DIR/gpu_bench.json, DIR/gpu_bench.png, DIR/gpu_tests.log) and one
table on stdout. The one command to run on a CUDA machine:

    python scripts/gpu_proof.py --out DIR [--tests DIR] [--no-tests] [--no-installer] [bench gpu options]

Every option that `specchat bench gpu` takes (--quick, --caps, --budgets, --max-minutes, ...)
passes through. The tests and the installer's check live here, not in the engine: an installed
copy has neither tests/ nor installer/. Without CUDA the bench part is its CPU dry run
(seconds) and the gpu tests are skipped. Exit status 1 when a section or a gpu test failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]  # the checkout holding engine/, tests/ and installer/
if str(ROOT) not in sys.path:  # run as a script: the checkout's engine, not an installed one
    sys.path.insert(0, str(ROOT))

from engine.cli.bench_gpu import TESTS_LOG, Deadline, Section, run_bench_gpu  # noqa: E402
from engine.cli.parser import build_parser  # noqa: E402
from engine.errors import MalformedInput  # noqa: E402
from engine.untrusted import MIB, read_text  # noqa: E402

BUDGETS = {"tests": (300, 180), "installer": (60, 60)}  # seconds (full, --quick)


def main(argv: list[str] | None = None) -> int:
    own = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                  epilog="Every option of `specchat bench gpu --help` passes through.")
    own.add_argument("--tests", type=Path, default=ROOT / "tests", metavar="DIR",
                     help="folder searched for gpu-marked tests (default: this checkout's tests/)")
    own.add_argument("--no-tests", action="store_true", help="skip the gpu-marked tests")
    own.add_argument("--no-installer", action="store_true", help="skip the installer's check")
    mine, rest = own.parse_known_args(argv)
    args = build_parser().parse_args(["bench", "gpu", *rest])
    pick = 1 if args.quick else 0
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    before: list[Section] = []
    if not mine.no_tests:
        before.append(("tests", BUDGETS["tests"][pick], lambda d, p: run_gpu_tests(mine.tests, out / TESTS_LOG, d)))
    if not mine.no_installer:
        before.append(("installer", BUDGETS["installer"][pick], lambda d, p: installer_check(d)))
    return run_bench_gpu(args, before)


def gpu_test_files(tests_dir: Path) -> list[Path]:
    """The test files that mark tests `gpu` (collecting only these keeps the run short and free
    of the app's Qt imports)."""
    return sorted(p for p in tests_dir.rglob("test_*.py") if _marks_gpu(p))


def _marks_gpu(path: Path) -> bool:
    """Whether a test file marks a test `gpu`; a file that is not a readable regular text file
    (a FIFO, a folder, a huge or binary file) does not."""
    try:
        return "mark.gpu" in read_text(path, what="a test file", max_bytes=4 * MIB)
    except (OSError, MalformedInput):
        return False


def parse_pytest(output: str) -> dict[str, Any]:
    """Counts from pytest's last summary line and the per-test lines of its -rA report."""
    summary = next((line for line in reversed(output.splitlines()) if re.search(r"\bin [\d.]+s\b", line)), "")
    counts = {word.rstrip("s") if word in ("errors", "warnings") else word: int(n)
              for n, word in re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed|warnings?)",
                                        summary)}
    tests = [line for line in output.splitlines() if re.match(r"(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) ", line)]
    return {"summary": summary.strip("= "), "counts": counts, "tests": tests}


def run_gpu_tests(tests_dir: Path, log_path: Path, deadline: Deadline) -> dict[str, Any]:
    """`pytest -m gpu` over the files that mark gpu tests, in a subprocess (before the bench
    takes any GPU memory); its output in `log_path`."""
    files = gpu_test_files(tests_dir) if tests_dir.is_dir() else []
    if not files:
        return {"outcome": f"no gpu-marked tests under {tests_dir}", "counts": {}}
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rA", "-p", "no:cacheprovider",
               *(str(f) for f in files)]
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=max(deadline.left(), 1.0))
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as exc:
        output = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output, code = output + "\n[bench gpu] pytest stopped: section time budget", None
    log_path.write_text(output, encoding="utf-8")
    parsed = parse_pytest(output)
    return {"command": " ".join(["python", *command[1:4], "..."]), "files": [str(f.relative_to(ROOT)) if
            f.is_relative_to(ROOT) else str(f) for f in files], "returncode": code, **parsed,
            "tail": output.splitlines()[-40:], "log": log_path.name}


def installer_check(deadline: Deadline) -> dict[str, Any]:
    """`installer/install.sh check`: the PyTorch build the installer would pick here."""
    script = ROOT / "installer" / "install.sh"
    done = subprocess.run(["sh", str(script), "check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=max(min(deadline.left(), 120.0), 1.0))
    lines = done.stdout.splitlines()
    return {"returncode": done.returncode, "torch_build": next((ln for ln in lines if ln.startswith("PyTorch")), None),
            "output": lines[-30:], "stderr": done.stderr.splitlines()[-10:]}


if __name__ == "__main__":
    sys.exit(main())
