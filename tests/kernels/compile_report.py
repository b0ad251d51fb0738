"""Compile every kernel for Hopper (sm_90) on a machine without a GPU; report registers, spills, loads.

    python tests/kernels/compile_report.py [--only qwen3|mla|skinny]

The figures are the installed Triton's; to read what the GPU machine's version builds, put it first on
the path (``pip install --target /tmp/t36 triton==3.6.0``, then ``PYTHONPATH=/tmp/t36``). Spills show
only where ptxas puts them: compiling a variant without a suspect block (a tail loop, an epilogue) and
comparing the stacks is how the MLA decode kernel's spilling tail tile was found (2026-12-08).

The wrappers run on CPU tensors of the real Qwen3-14B shapes, but ``JITFunction.run`` is replaced by a
compile-only stand-in that specialises arguments as a real launch does (16-byte-aligned pointers and
multiples of 16 get ``tt.divisibility``, ints equal to 1 become constants) and compiles through the
ptxas bundled with Triton. A codegen error surfaces here without GPU time; the table shows registers,
stack bytes (spills), shared memory, whether global loads are 16-byte (``v4`` / ``cp.async``) and the MMA
flavour (Hopper's ``wgmma`` or ``mma.sync``). ``--only mla``: the DeepSeek MLA decode kernel's forms at
DeepSeek-V3's shape (the dispatch's TMA tiling, the kernel's defaults, one output half a program).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

os.environ.pop("TRITON_INTERPRET", None)  # compile, never interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
_TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.int64: "i64",
}
_SHOWN = (
    "GROUP", "HEAD_DIM", "BLOCK_M", "BLOCK_N", "SPLIT", "DOT_PREC", "HAS_RES", "WRITE_CACHE", "BLOCK_H",
    "BLOCK_V", "HALVES", "BLOCK_K", "NORM", "SILU", "RESIDUAL", "N", "K",
)  # fmt: skip
rows: list[tuple[str, ...]] = []


def _compile_only(self: JITFunction, *args, grid, warmup, **kwargs):
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    bound = dict(zip(self.arg_names, args, strict=False)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(self.params):
        value = bound[param.name]
        if param.is_constexpr or (type(value) is int and value == 1):
            signature[param.name], constants[param.name] = "constexpr", value
            continue
        if isinstance(value, TensorDescriptor):
            block = ",".join(str(b) for b in value.block_shape)
            signature[param.name], aligned = f"tensordesc<{_TYPES[value.base.dtype]}[{block}]>", False
        elif isinstance(value, torch.Tensor):
            signature[param.name] = "*" + _TYPES[value.dtype]
            aligned = value.data_ptr() % 16 == 0
        elif isinstance(value, bool):
            signature[param.name], aligned = "i1", False
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            aligned = value % 16 == 0 and value != 0
        else:
            signature[param.name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    kernel = triton.compile(ASTSource(self, signature, constants, attrs), target=TARGET, options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([CUOBJDUMP, "--dump-resource-usage", f.name], capture_output=True, text=True)
    res = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    ptx = kernel.asm["ptx"]
    wide = bool(re.search(r"ld\.global(\.\w+)*\.v4|cp\.async\.cg", ptx))
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
    shown = {k: v for k, v in constants.items() if k in _SHOWN}
    usage_figures = res.groups() if res else ("?", "?")
    rows.append(
        (self.__name__, str(shown), str(options), *usage_figures, str(kernel.metadata.shared), str(wide), mma)
    )


def qwen3_kernels() -> None:
    """Qwen3-14B's decode and prefill kernels at its real shapes, bf16 and fp32."""
    from pegainfer.kernels import activations, norms, rope_kv
    from pegainfer.kernels.paged_decode_attention import paged_decode_attention_triton
    from pegainfer.kernels.paged_prefill_attention import PrefillTensors, paged_prefill_attention_triton
    from pegainfer.layers.rotary import RotaryEmbedding

    heads, kv_heads, d = 40, 8, 128
    ints = torch.zeros(3, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float32):
        cache = torch.empty(2, 64, 16, kv_heads, d, dtype=dtype)
        q = torch.empty(8, heads, d, dtype=dtype)
        tables, lens = torch.zeros(8, 64, dtype=torch.int32), torch.zeros(8, dtype=torch.int32)
        for splits in (1, 4):
            paged_decode_attention_triton(q, cache, tables, lens, 0.1, num_splits=splits)
        meta = PrefillTensors(ints, ints, ints, torch.zeros(3, 64, dtype=torch.int32), 100, 1000)
        paged_prefill_attention_triton(torch.empty(100, heads, d, dtype=dtype), cache, meta, 0.1)
        x, w = torch.empty(4, 5120, dtype=dtype), torch.empty(5120, dtype=dtype)
        norms.rms_norm_triton(x, w, 1e-6)
        norms.fused_add_rms_norm_triton(x, x.clone(), w, 1e-6)
        activations.silu_mul_triton(torch.empty(4, 2 * 17408, dtype=dtype))
        qkv = torch.empty(4, (heads + 2 * kv_heads) * d, dtype=dtype)
        qv, kv, vv = (t.view(4, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1))
        pos = torch.zeros(4, dtype=torch.int64)
        rotary = RotaryEmbedding(d, 1e6, 64)
        rope_kv.qk_norm_rope_triton(qv, kv, w[:d], w[:d], rotary, pos, 1e-6)
        rope_kv.qk_norm_rope_triton(
            qv, kv, w[:d], w[:d], rotary, pos, 1e-6, kv_cache=cache, v=vv, slot_mapping=pos
        )
        rope_kv.write_kv_triton(cache, kv, vv, pos)


def mla_kernels() -> None:
    """The MLA decode kernel at DeepSeek-V3's shape (128 heads, latent 512 + rope 64, 64-token pages,
    bf16, split partials): the dispatch's TMA tiling, the kernel's defaults, one output half a program."""
    from pegainfer_deepseek import mla_decode as mla

    batch, heads, rkv, dr = 64, 128, 512, 64
    q = torch.empty(heads, batch, rkv, dtype=torch.bfloat16).transpose(0, 1)  # absorbed: [H, B] memory
    q_pe = torch.empty(batch, heads, dr, dtype=torch.bfloat16)
    cache = torch.empty(batch * 64, 64, rkv + dr, dtype=torch.bfloat16)
    tables, lens = torch.zeros(batch, 64, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)
    for tiling in (mla.TMA_TILING, {}, dict(mla.TMA_TILING, block_v=rkv // 2, num_warps=4)):
        mla.mla_decode_attention_triton(
            q, q_pe, cache, tables, lens, 0.1, max_seq_len=4096, num_splits=2, **tiling
        )


#: (N, K) of the decode projections the skinny GEMM runs, with the fusions the step uses on each.
SKINNY = {
    "qwen3_14b": [((7168, 5120), "norm"), ((5120, 5120), "residual"), ((34816, 5120), "norm_silu"),
                  ((5120, 17408), "residual"), ((151936, 5120), "norm")],
    "qwen35_9b": [((12352, 4096), "norm"), ((4096, 4096), "residual"), ((24576, 4096), "norm_silu"),
                  ((4096, 12288), "residual")],
}  # fmt: skip


def skinny_kernels() -> None:
    """The skinny GEMM at the Qwen3-14B and Qwen3.5-9B decode projections, one row and 16, with the
    fusions the step gives each (folded norm, SiLU·mul of interleaved gate|up, residual)."""
    from pegainfer.kernels.skinny_gemm import skinny_linear_triton

    for shapes in SKINNY.values():
        for (n, k), fused in shapes:
            w = torch.empty(n, k, dtype=torch.bfloat16)
            for rows in (1, 16):
                x = torch.empty(rows, k, dtype=torch.bfloat16)
                skinny_linear_triton(
                    x, w, norm_eps=1e-6 if "norm" in fused else None, silu="silu" in fused,
                    residual=torch.empty(rows, n, dtype=torch.bfloat16) if fused == "residual" else None,
                )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["qwen3", "mla", "skinny"], default=None)
    args = parser.parse_args()
    JITFunction.run = _compile_only
    if args.only in (None, "qwen3"):
        qwen3_kernels()
    if args.only in (None, "mla"):
        mla_kernels()
    if args.only in (None, "skinny"):
        skinny_kernels()
    header = ("kernel", "constants", "options", "regs", "stack", "shared", "16B loads", "mma")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


if __name__ == "__main__":
    main()
