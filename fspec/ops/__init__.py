"""The Python side of each op: attention (paged, dense, and over the dense caches), sampling and verification.

Imports fspec.kernels and fspec.core only.
"""
