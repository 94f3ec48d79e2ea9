"""Values and their algebra: pytrees, static configs, the state pytrees, metadata, the paged KV cache.

Imports nothing of fspec but fspec.kernels.
"""
