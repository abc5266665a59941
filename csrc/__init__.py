"""CUDA C++ sources of ragged (package data; compiled at first use by ragged.kernels.cuda)."""
