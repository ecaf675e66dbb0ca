"""Triton kernels for the batch-1 CUDA hot path: functional entry points a layer can call.

One module per kernel family, each with its kernel(s), an entry point that checks and launches them, and the eager
reference it is tested against: ``norm`` (RMSNorm, fused residual add), ``rope`` (q/k(/v) norm and RoPE), ``attention``
(split-K attention over an indexed K/V pool), ``moe`` (router top-k and the routed experts, each expert's weights read
once) and ``head`` (soft-cap and greedy choice on the device).

Only ``attention`` is called by the models yet (the batched steps on CUDA). They need ``triton`` (Linux; CUDA, or the
CPU under ``TRITON_INTERPRET=1``, as ``tests/kernels`` runs them). See docs/cuda.md.
"""
