"""The CPU kernels: C++ sources (csrc/), built once per machine and loaded into torch.ops.pinfer (kernels.py), and
the dispatch of matrix products over weight types (qops.py)."""
