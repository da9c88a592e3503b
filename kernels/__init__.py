"""Attention and GEMM kernels with pure-torch reference twins.

Installed as ``localgen.kernels``; nothing here imports the rest of localgen.
"""
