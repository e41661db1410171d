"""The Triton kernels of moetier/model/triton_experts.py (imported only where it runs them: triton is on the GPU
machine, not a dependency of moetier)."""

import triton
import triton.language as tl


@triton.jit
def weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK rows, BLOCK_K] of a matrix's weights, rounded to bf16 as `dequantize` rounds them."""
    if BITS == 8:
        q = tl.load(codes + rows[:, None] * stride_c + k[None, :]).to(tl.float32)
        s = tl.load(scales + rows).to(tl.float32)
        w = q * s[:, None]
    else:
        per: tl.constexpr = 8 // BITS
        byte = tl.load(codes + rows[:, None] * stride_c + (k // per)[None, :]).to(tl.int32)
        q = ((byte >> ((k % per) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        g = k // GROUP
        s = tl.load(scales + rows[:, None] * stride_s + g[None, :]).to(tl.float32)
        z = tl.load(zeros + rows[:, None] * stride_s + g[None, :]).to(tl.float32)
        w = (q - (1 << (BITS - 1))) * s + z
    return w.to(tl.bfloat16).to(tl.float32)  # (bf16 values, multiplied in fp32: exact in tf32 too, and the
    # interpreter's bf16 tl.dot, which CPU tests run, is wrong)


@triton.jit
def gate_up(x, codes, scales, zeros, h, T, K, I, stride_x, stride_c, stride_s, stride_h,
            BITS: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """h [T, I] = silu(x @ gate.T) * (x @ up.T), gate the first I rows of gate_up_proj, up the next I."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    t = tl.arange(0, BT)
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xb = tl.load(x + t[:, None] * stride_x + k[None, :], mask=t[:, None] < T, other=0.0).to(tl.float32)
        wg = weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP)
        wu = weights_block(codes, scales, zeros, rows + I, k, stride_c, stride_s, BITS, GROUP)
        acc_g += tl.dot(xb, tl.trans(wg))
        acc_u += tl.dot(xb, tl.trans(wu))
    gate = acc_g.to(tl.bfloat16).to(tl.float32)  # (rounded where the reference's bf16 linear rounds)
    up = acc_u.to(tl.bfloat16).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32)
    out = (silu * up).to(tl.bfloat16)
    tl.store(h + t[:, None] * stride_h + rows[None, :], out, mask=t[:, None] < T)


@triton.jit
def down(h, codes, scales, zeros, weights, out, T, I, stride_h, stride_c, stride_s, stride_o,
         BITS: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out [T, H] = (h @ down.T) * weights[:, None]."""
    rows = tl.program_id(0) * BN + tl.arange(0, BN)
    t = tl.arange(0, BT)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        hb = tl.load(h + t[:, None] * stride_h + k[None, :], mask=t[:, None] < T, other=0.0).to(tl.float32)
        wd = weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP)
        acc += tl.dot(hb, tl.trans(wd))
    w = tl.load(weights + t, mask=t < T, other=0.0).to(tl.float32)
    y = acc.to(tl.bfloat16).to(tl.float32) * w[:, None]
    tl.store(out + t[:, None] * stride_o + rows[None, :], y.to(tl.bfloat16), mask=t[:, None] < T)
