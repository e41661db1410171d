"""The Triton kernels of moetier/model/triton_experts.py (imported only where it runs them: triton is on the GPU
machine, not a dependency of moetier).

Both kernels compute a whole layer's experts in one launch: program (g, n) takes group g's pair rows —
spans[g, 0]..spans[g, 1], at most BT of them — through block n of the expert's output rows. The
expert of group g is row experts[g] of `table`, eight addresses an expert (gate_up_proj's codes, scales and zeros,
then down_proj's, then the two matrices' biases; a bf16 expert's scales and zeros and a SwiGLU expert's biases are
never read): the slots are wherever the cache put them, and one table of their addresses replaces a launch an
expert. Pair row r reads activation row x_rows[r].

ACT 0 is SwiGLU, silu(gate)·up; ACT 1 gpt-oss's clamped SwiGLU with biases (moetier/model/expert_kernels.py
ClampedSwigluExpert, ggml_experts.py GgmlClampedExpert): each product's bias added in fp32 before its rounding,
gate clamped to `limit` from above, up to ±limit, then (up + 1)·gate·sigmoid(alpha·gate), each op rounded to bf16
where torch's bf16 ops round. BIAS: the biases' dtype (16 bf16, 32 fp32; 0 none)."""

import triton
import triton.language as tl

COLUMNS: tl.constexpr = tl.constexpr(8)  # a table row's addresses (moetier/model/triton_experts.py NAMES)


@triton.jit
def expert_address(table, e, col: tl.constexpr, BITS: tl.constexpr, SCALES: tl.constexpr):
    """Column `col` of expert e's row of addresses, as a pointer to what it holds: codes (bf16 weights at BITS 16,
    int8 codes, or bytes of packed int4/int2 codes), or with SCALES a bf16 scale or zero."""
    address = tl.load(table + e * COLUMNS + col)
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
def f16_at(codes, offset):
    """The little-endian fp16 at byte `offset` of `codes` (uint8), as fp32."""
    bits = tl.load(codes + offset).to(tl.int32) | (tl.load(codes + offset + 1).to(tl.int32) << 8)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def k_scale_min(codes, base, sub):
    """A q4_k/q5_k block's six-bit scale and min of sub-block `sub` (0..7) from its 12 bytes at base + 4 (ggml's
    get_scale_min_k4; moetier/quant/ggml_blocks.py scale_min_k4)."""
    a = tl.load(codes + base + 4 + sub).to(tl.int32)  # q[j]
    b = tl.load(codes + base + 8 + sub).to(tl.int32)  # q[j + 4]
    c = tl.load(codes + base + 4 + tl.maximum(sub - 4, 0)).to(tl.int32)  # q[j − 4] (j ≥ 4)
    first = sub < 4
    sc = tl.where(first, a & 63, (b & 0xF) | ((c >> 6) << 4))
    mn = tl.where(first, b & 63, (b >> 4) | ((a >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def ggml_block(codes, rows, k, stride_c, FMT: tl.constexpr):
    """[BLOCK rows, BLOCK_K] of a matrix in a GGML block format (rows of blocks, one row after another: uint8
    [N, row bytes]) as fp32, as moetier/quant/ggml_blocks.py's `dequantize` computes them (the same products in the
    same order). FMT 1 q8_0, 2 q4_k, 3 q5_k, 4 q6_k, 5-8 q4_0, q4_1, q5_0, q5_1, 9 mxfp4 (GGML_FORMATS in
    triton_experts.py)."""
    row = rows[:, None] * stride_c  # [BN, 1] each row's first byte
    if FMT == 1:  # 32 weights a block of 34 bytes: fp16 d, int8 q[32]; w = d·q
        base = row + (k // 32 * 34)[None, :]
        q = tl.load(codes + base + 2 + (k % 32)[None, :]).to(tl.int8).to(tl.float32)
        w = f16_at(codes, base) * q
    elif FMT == 2 or FMT == 3:  # 256 a block: fp16 d, dmin; 12 bytes of scales and mins; (q5_k: fifth bits
        # qh[32]); nibbles [128], each 32 bytes' low nibbles a sub-block of 32, their high ones the next
        size: tl.constexpr = 144 if FMT == 2 else 176
        nibbles: tl.constexpr = 16 if FMT == 2 else 48
        base = row + (k // 256 * size)[None, :]
        t = (k % 256)[None, :]
        sub, lane = t // 32, t % 32  # sub-block 0..7: chunk sub // 2 of 32 bytes, its high nibbles if odd
        q = (tl.load(codes + base + nibbles + (sub // 2) * 32 + lane).to(tl.int32) >> ((sub % 2) * 4)) & 0xF
        if FMT == 3:  # sub-block j's fifth bit is bit j of qh[lane]
            q = q | (((tl.load(codes + base + 16 + lane).to(tl.int32) >> sub) & 1) << 4)
        sc, mn = k_scale_min(codes, base, sub)
        w = (f16_at(codes, base) * sc) * q.to(tl.float32) - f16_at(codes, base + 2) * mn
    elif FMT == 4:  # q6_k: 256 a block of 210 bytes: ql[128], qh[64], int8 scales[16] (one per 16 weights), fp16 d
        base = row + (k // 256 * 210)[None, :]
        t = (k % 256)[None, :]
        half, quad, lane = t // 128, (t % 128) // 32, t % 32
        lo = (tl.load(codes + base + half * 64 + (quad % 2) * 32 + lane).to(tl.int32) >> ((quad // 2) * 4)) & 0xF
        hi = (tl.load(codes + base + 128 + half * 32 + lane).to(tl.int32) >> (quad * 2)) & 3
        scale = tl.load(codes + base + 192 + t // 16).to(tl.int8).to(tl.float32)
        w = (f16_at(codes, base + 208) * scale) * ((lo | (hi << 4)) - 32).to(tl.float32)
    elif FMT == 9:  # mxfp4: 32 weights a block of 17 bytes: an E8M0 exponent e, nibbles [16] of E2M1 codes (low:
        # weights 0-15); w = 2^(e − 128) · the code's value doubled (0, 1, 2, 3, 4, 6, 8, 12, then the same negated),
        # the scale's bits made as ggml's GGML_E8M0_TO_FP32_HALF makes them (e < 2: a subnormal)
        base = row + (k // 32 * 17)[None, :]
        j = (k % 32)[None, :]
        q = (tl.load(codes + base + 1 + j % 16).to(tl.int32) >> ((j // 16) * 4)) & 0xF
        m = q & 7
        v = tl.where(m < 4, m, (2 + (m & 1)) << tl.maximum((m >> 1) - 1, 0))
        v = tl.where(q >= 8, -v, v)
        e = tl.load(codes + base).to(tl.int32)
        bits = tl.where(e < 2, 0x00200000 << e, (e - 1) << 23)
        w = bits.to(tl.float32, bitcast=True) * v.to(tl.float32)
    else:  # the legacy formats llama-quantize falls back to where a row is not whole 256-blocks (5 q4_0, 6 q4_1,
        # 7 q5_0, 8 q5_1): 32 weights a block; fp16 d (and m: w = d·q + m, else w = d·(q − 8 or 16)); q5's fifth bits
        # qh (4 bytes, weight j's the j-th bit); nibbles [16], their low ones weights 0-15, the high ones 16-31
        size: tl.constexpr = 18 if FMT == 5 else (20 if FMT == 6 else (22 if FMT == 7 else 24))
        nibbles: tl.constexpr = size - 16
        base = row + (k // 32 * size)[None, :]
        j = (k % 32)[None, :]
        q = (tl.load(codes + base + nibbles + j % 16).to(tl.int32) >> ((j // 16) * 4)) & 0xF
        if FMT == 7 or FMT == 8:
            q = q | (((tl.load(codes + base + nibbles - 4 + j // 8).to(tl.int32) >> (j % 8)) & 1) << 4)
        if FMT == 5 or FMT == 7:
            w = f16_at(codes, base) * (q - (8 if FMT == 5 else 16)).to(tl.float32)
        else:
            w = f16_at(codes, base) * q.to(tl.float32) + f16_at(codes, base + 2)
    return w  # (one return, as weights_block)


@triton.jit
def weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS: tl.constexpr, GROUP: tl.constexpr,
                  FMT: tl.constexpr = 0):
    """[BLOCK rows, BLOCK_K] of a matrix's weights as fp32: bf16 ones as they are, codes rounded to bf16 as
    `dequantize` rounds them; with FMT a GGML block format's (ggml_block: fp32, not rounded)."""
    if FMT != 0:
        w = ggml_block(codes, rows, k, stride_c, FMT)
    elif BITS == 16:
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
def product(a, b, FMT: tl.constexpr):
    """a @ b.T in fp32: tf32's tensor cores for bf16 values (exact there); IEEE products for a GGML format's fp32
    weights, which tf32's ten-bit mantissa would round."""
    if FMT == 0:
        y = tl.dot(a, tl.trans(b))
    else:
        y = tl.dot(a, tl.trans(b), input_precision="ieee")
    return y


@triton.jit
def bias_of(table, experts, g, col: tl.constexpr, rows, BIAS: tl.constexpr, FMT: tl.constexpr):
    """[BN] of group g's expert's bias at table column `col` (6: gate_up_proj's, 7: down_proj's) as fp32 — a float
    or codes expert's rounded to bf16, as the reference takes its biases in the weights' dtype; a GGML one's fp32,
    as GgmlClampedExpert adds them."""
    address = tl.load(table + tl.load(experts + g) * COLUMNS + col)
    if BIAS == 16:
        b = tl.load(address.to(tl.pointer_type(tl.bfloat16)) + rows).to(tl.float32)
    else:
        b = tl.load(address.to(tl.pointer_type(tl.float32)) + rows)
        if FMT == 0:
            b = b.to(tl.bfloat16).to(tl.float32)
    return b


@triton.jit
def bf16(v):
    """v rounded to bf16, as fp32 (where a bf16 op of the reference rounds)."""
    return v.to(tl.bfloat16).to(tl.float32)


@triton.jit
def glu(acc_g, acc_u, alpha, limit, ACT: tl.constexpr):
    """[BT, BN] of the activation from gate's and up's fp32 sums (biases added), rounded as torch's bf16 ops round."""
    gate = bf16(acc_g)  # (rounded where the reference's bf16 linear rounds)
    up = bf16(acc_u)
    if ACT == 0:
        h = bf16(gate / (1.0 + tl.exp(-gate))) * up
    else:  # (up + 1) · gate · sigmoid(alpha · gate), gate ≤ limit, |up| ≤ limit
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        sig = bf16(1.0 / (1.0 + tl.exp(-bf16(gate * alpha))))
        h = bf16(up + 1.0) * bf16(gate * sig)
    return h


@triton.jit
def gate_up(x, x_rows, table, experts, spans, h, K, I, stride_x, stride_c, stride_s, stride_h, alpha, limit,
            BITS: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
            FMT: tl.constexpr = 0, ACT: tl.constexpr = 0, BIAS: tl.constexpr = 0):
    """h [P, I] = glu(x @ gate.T, x @ up.T) for each pair row, gate the first I rows of its expert's gate_up_proj,
    up the next I (with BIAS, each plus its bias)."""
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
        wg = weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP, FMT)
        wu = weights_block(codes, scales, zeros, rows + I, k, stride_c, stride_s, BITS, GROUP, FMT)
        acc_g += product(xb, wg, FMT)
        acc_u += product(xb, wu, FMT)
    if BIAS != 0:
        acc_g += bias_of(table, experts, g, 6, rows, BIAS, FMT)[None, :]
        acc_u += bias_of(table, experts, g, 6, rows + I, BIAS, FMT)[None, :]
    tl.store(h + r[:, None] * stride_h + rows[None, :], glu(acc_g, acc_u, alpha, limit, ACT).to(tl.bfloat16),
             mask=live[:, None])


@triton.jit
def down(h, table, experts, spans, weights, out, I, stride_h, stride_c, stride_s, stride_o,
         BITS: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         FMT: tl.constexpr = 0, BIAS: tl.constexpr = 0):
    """out [P, H] = (h @ down.T (+ its bias)) * weights[:, None] for each pair row, with its expert's down_proj."""
    g, n = tl.program_id(0), tl.program_id(1)
    r, live = group_rows(spans, g, BT)  # [BT] pair rows
    codes, scales, zeros = group_matrix(table, experts, g, 3, BITS)
    rows = n * BN + tl.arange(0, BN)
    acc = tl.zeros((BT, BN), dtype=tl.float32)
    for k0 in range(0, I, BK):
        k = k0 + tl.arange(0, BK)
        hb = tl.load(h + r[:, None] * stride_h + k[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        wd = weights_block(codes, scales, zeros, rows, k, stride_c, stride_s, BITS, GROUP, FMT)
        acc += product(hb, wd, FMT)
    if BIAS != 0:
        acc += bias_of(table, experts, g, 7, rows, BIAS, FMT)[None, :]
    w = tl.load(weights + r, mask=live, other=0.0).to(tl.float32)
    y = bf16(acc) * w[:, None]
    tl.store(out + r[:, None] * stride_o + rows[None, :], y.to(tl.bfloat16), mask=live[:, None])
