"""Triton kernels of the GPU fast path, each beside its torch reference and behind one wrapper that
takes the kernel for CUDA tensors and the reference elsewhere:

- ``paged_decode_attention``: decode over the paged KV cache (GQA, split-K, CUDA-graph safe);
- ``paged_prefill_attention``: prefill / chunked prefill with a cached prefix, many segments per launch;
- ``fused_ops``: RMSNorm (+ residual add), q/k norm + rotary (+ KV write), SiLU·mul, KV write.

Nothing is imported here, so ``import pegainfer.kernels`` costs nothing until a module is used.
"""
