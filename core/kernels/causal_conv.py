"""One token of a depthwise causal conv over a window kept in a state slot, then SiLU: the Triton helper
that a linear-attention layer's conv update shares with the decode GEMM's epilogue
(``skinny_gemm.ConvStep``), so both round and shift the window the same way.

The window holds the last ``K - 1`` inputs of each channel in fp32 (model-dtype values, exactly); the
conv's sum is rounded to the model dtype before the SiLU, as the torch reference's conv in that dtype is.
"""

from __future__ import annotations

from pegainfer.kernels._triton import cast_to, tl, triton


@triton.jit
def causal_conv_silu_step(y, win, taps, upd, ok, K: tl.constexpr, DTYPE: tl.constexpr, FIX: tl.constexpr):
    """SiLU of the conv of each element's window and its new input ``y`` ``[R, C]`` (rows by channels;
    fp32 of model-dtype values), and the windows shifted in place. ``win`` ``[R, C]``: pointers of each
    element's window (``K - 1`` consecutive fp32 entries, oldest first); ``taps`` ``[C]``: pointers of each
    channel's ``K`` weights; ``upd`` ``[R, C]``: where a window is read and shifted (elsewhere it counts as
    zeros); ``ok`` ``[C]``: the channels whose taps are valid. Returns the fp32 SiLU output ``[R, C]`` (the
    caller rounds it where it stores)."""
    acc = tl.load(taps + (K - 1), mask=ok, other=0.0).to(tl.float32)[None, :] * y
    for j in tl.static_range(K - 1):
        old = tl.load(win + j, mask=upd, other=0.0)
        acc += tl.load(taps + j, mask=ok, other=0.0).to(tl.float32)[None, :] * old
    acc = cast_to(acc, DTYPE, FIX).to(tl.float32)
    # Shift the window: entry j takes entry j + 1 (read before it is overwritten), the last the new input.
    for j in tl.static_range(K - 2):
        tl.store(win + j, tl.load(win + j + 1, mask=upd, other=0.0), mask=upd)
    tl.store(win + (K - 2), y, mask=upd)
    return acc / (1.0 + tl.exp(-acc))
