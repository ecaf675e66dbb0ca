"""Triton kernels for the batch-1 CUDA hot path: functional entry points a layer can call.

One module per kernel family, each with its kernel(s), an entry point that checks and launches them,
and the eager reference it is tested and benchmarked against:

* ``norm``      -- RMSNorm, and the residual add fused with the next norm (Gemma-4 and Qwen3 conventions);
* ``rope``      -- q/k(/v) RMSNorm and RoPE of a fused q/k/v projection's rows;
* ``attention`` -- split-K (flash-decoding) attention of a few query rows over a K/V pool read
  through an index table (the sliding ring and the full buffers), GQA folded, masked by positions;
* ``moe``       -- the router's top-k, and the routed experts for a few rows reading each routed
  expert's weights once (the expert-union floor);
* ``head``      -- the LM head's soft-cap and the greedy choice on the device.

Only ``attention`` is called by the models yet (the batched steps on CUDA); the others wait for issue 60's
GPU measurements. They need ``triton`` (Linux; CUDA, or the CPU under ``TRITON_INTERPRET=1``, as
``tests/kernels`` runs them). See docs/cuda.md.
"""
