"""The Python side of each op: attention, the unrolled-TTT attention, sampling and verification.

Imports fspec.kernels and fspec.core only.
"""
