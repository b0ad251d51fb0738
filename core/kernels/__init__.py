"""Triton kernels of the GPU fast path, each beside its torch reference and behind one wrapper that
takes the kernel for CUDA tensors and the reference elsewhere:

- ``paged_decode_attention``: decode over the paged KV cache (GQA, split-K, CUDA-graph safe);
- ``paged_prefill_attention``: prefill / chunked prefill with a cached prefix, many segments per launch;
- ``norms``: RMSNorm, and RMSNorm after a residual add (the residual updated in place);
- ``rope_kv``: per-head q/k RMSNorm + rotary (+ KV write), and the KV write by slot on its own;
- ``activations``: SiLU·mul of the packed gate|up projection.

Nothing is imported here, so ``import pegainfer.kernels`` costs nothing until a module is used.
"""
