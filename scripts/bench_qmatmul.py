"""Packed CPU kernel (engine/kernels) against PyTorch's fp32 Linear: microseconds per product,
best of several runs, at a decode step's and a tree pass's row counts, at the starter's and a
1B model's shapes. `python scripts/bench_qmatmul.py [threads]`."""

from __future__ import annotations

import sys
import time

import torch

from engine.kernels.linear import from_dense, qlinear

SHAPES = [(1536, 576), (576, 1536), (49152, 576), (5632, 2048), (2048, 5632)]
ROWS = (1, 4, 16, 64)


def best(f: object, runs: int = 20) -> float:
    f(), f()  # type: ignore[operator]
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        f()  # type: ignore[operator]
        times.append(time.perf_counter() - t)
    return min(times) * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print(f"{torch.get_num_threads()} threads; microseconds, best of 20")
    print(f"{'N x K':>12} {'M':>3} {'fp32':>9} {'q8':>9} {'q4':>9} {'fp32/q8':>8} {'fp32/q4':>8}")
    for n, k in SHAPES:
        w = torch.randn(n, k)
        q8, q4 = from_dense(w, "q8"), from_dense(w, "q4")
        for m in ROWS:
            x = torch.randn(m, k)
            d = best(lambda: torch.nn.functional.linear(x, w))
            a = best(lambda: qlinear(x, q8))
            b = best(lambda: qlinear(x, q4))
            print(f"{n:>6}x{k:<5} {m:>3} {d:>9.0f} {a:>9.0f} {b:>9.0f} {d / a:>8.2f} {d / b:>8.2f}")


if __name__ == "__main__":
    main()
