"""Native CPU kernels: matrix products with group-quantised weights (qmatmul.c), compiled on
first use (build.py) and run through ctypes (linear.py: PackedLinear, a drop-in inference
Linear). Where no kernel can be built, callers run their dense path; nothing here raises for
want of a compiler.

What this package does not do: read model files or place layers (engine.loading).
"""
