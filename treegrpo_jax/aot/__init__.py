"""Ahead-of-time compiles for hardware this host does not have: a run's every program compiled for a
TPU topology by the TPU compiler (libtpu) on a CPU host, with its memory, cost and a predicted time
(`launch/compile.py`, `treegrpo-compile`)."""
