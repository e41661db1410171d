"""The Triton kernels of moetier/model/triton_experts.py (imported only where it runs them: triton is on the GPU
machine, not a dependency of moetier).

Both kernels compute a whole layer's experts in one launch: program (g, n) takes group g's pair rows —
spans[g, 0]..spans[g, 1], at most BT of them — through block n of the expert's output rows. The
expert of group g is row experts[g] of `table`, six addresses an expert (gate_up_proj's codes, scales and zeros,
then down_proj's; a bf16 expert's scales and zeros are never read): the slots are wherever the cache put them, and
one table of their addresses replaces a launch an expert. Pair row r reads activation row x_rows[r]."""

import triton
import triton.language as tl


@triton.jit
def expert_address(table, e, col: tl.constexpr, BITS: tl.constexpr, SCALES: tl.constexpr):
    """Column `col` of expert e's row of addresses, as a pointer to what it holds: codes (bf16 weights at BITS 16,
    int8 codes, or bytes of packed int4/int2 codes), or with SCALES a bf16 scale or zero."""
    address = tl.load(table + e * 6 + col)
    if SCALES or BITS == 16:
        pointer = address.to(tl.pointer_type(tl.bfloat16))
    elif BITS == 8:
        pointer = address.to(tl.pointer_type(tl.int8))
    else:
        pointer = address.to(tl.pointer_type(tl.uint8))
    return pointer  # (one return: past a return in a constexpr `if`, Triton still compiles what follows, dead)


@triton.jit
def group_matrix(table, experts, g, first: tl.constexpr, BITS: tl.constexpr):
    """(codes, scales, zeros) of group g's expert's matrix whose addresses start at column `first` (0: gate_up_proj,
    3: down_proj)."""
    e = tl.load(experts + g)
    return (expert_address(table, e, first, BITS, False), expert_address(table, e, first + 1, BITS, True),
            expert_address(table, e, first + 2, BITS, True))


@triton.jit
def group_rows(spans, g, BT: tl.constexpr):
    """Group g's pair rows, a tile of BT from its first ([BT]), and which of them are its (spans[g, 1] ends them)."""
    r = tl.load(spans + 2 * g) + tl.arange(0, BT)
    return r, r < tl.load(spans + 2 * g + 1)


@triton.jit
def weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr):
    """[BLOCK rows, BLOCK_K] of a matrix's weights as fp32: bf16 ones as they are, codes rounded to bf16 as
    `dequantize` rounds them."""
    if BITS == 16:
        w = tl.load(codes + rows[:, None] * stride_c + k[None, :]).to(tl.float32)
    elif BITS == 8:
        q = tl.load(codes + rows[:, None] * stride_c + k[None, :]).to(tl.float32)
        s = tl.load(scales + rows).to(tl.float32)
        w = (q * s[:, None]).to(tl.bfloat16).to(tl.float32)
    else:
        per: tl.constexpr = 8 // BITS
        byte = tl.load(codes + rows[:, None] * stride_c + (k // per)[None, :]).to(tl.int32)
        q = ((byte >> ((k % per) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        g = k // GROUP
        s = tl.load(scales + rows[:, None] * stride_s + g[None, :]).to(tl.float32)
        z = tl.load(zeros + rows[:, None] * stride_s + g[None, :]).to(tl.float32)
        w = ((q - (1 << (BITS - 1))) * s + z).to(tl.bfloat16).to(tl.float32)
    return w  # (bf16 values, multiplied in fp32: exact in tf32 too, and the interpreter's bf16 tl.dot, which CPU
    # tests run, is wrong; one return: past a return in a constexpr `if`, Triton still compiles what follows, dead)


@triton.jit
def gate_up(x, x_rows, table, experts, spans, h, K, I, stride_x, stride_c, stride_s, stride_h,
            BITS: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """h [P, I] = silu(x @ gate.T) * (x @ up.T) for each pair row, gate the first I rows of its expert's
    gate_up_proj, up the next I."""
    g, n = tl.program_id(0), tl.program_id(1)
    r, live = group_rows(spans, g, BT)  # [BT] pair rows
    codes, scales, zeros = group_matrix(table, experts, g, 0, BITS)
    xr = tl.load(x_rows + r, mask=live, other=0)
    rows = n * BN + tl.arange(0, BN)
    acc_g = tl.zeros((BT, BN), dtype=tl.float32)
    acc_u = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        xb = tl.load(x + xr[:, None] * stride_x + k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        wg = weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP)
        wu = weights_block(codes, scales, zeros, rows + I, k, stride_c, stride_s, BITS, GROUP)
        acc_g += tl.dot(xb, tl.trans(wg))
        acc_u += tl.dot(xb, tl.trans(wu))
    gate = acc_g.to(tl.bfloat16).to(tl.float32)  # (rounded where the reference's bf16 linear rounds)
    up = acc_u.to(tl.bfloat16).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(tl.bfloat16).to(tl.float32)
    tl.store(h + r[:, None] * stride_h + rows[None, :], (silu * up).to(tl.bfloat16), mask=live[:, None])


@triton.jit
def down(h, table, experts, spans, weights, out, I, stride_h, stride_c, stride_s, stride_o,
         BITS: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """out [P, H] = (h @ down.T) * weights[:, None] for each pair row, with its expert's down_proj."""
    g, n = tl.program_id(0), tl.program_id(1)
    r, live = group_rows(spans, g, BT)  # [BT] pair rows
    codes, scales, zeros = group_matrix(table, experts, g, 3, BITS)
    rows = n * BN + tl.arange(0, BN)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        hb = tl.load(h + r[:, None] * stride_h + k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        wd = weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP)
        acc += tl.dot(hb, tl.trans(wd))
    w = tl.load(weights + r, mask=live, other=0.0).to(tl.float32)
    y = acc.to(tl.bfloat16).to(tl.float32) * w[:, None]
    tl.store(out + r[:, None] * stride_o + rows[None, :], y.to(tl.bfloat16), mask=live[:, None])
