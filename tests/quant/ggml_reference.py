"""ggml's reference quantizers (ggml-quants.c: quantize_row_q8_0_ref, quantize_row_q{4,5,6}_K_ref and the
make_qkx2_quants / make_qx_quants they call) transliterated line by line, in float32 scalars summed one term after
another as the C does: slow, for a few blocks, the reference moetier.quant.kquants is checked against."""

import numpy as np

F = np.float32


def nearest_int(v) -> int:
    return int(np.rint(F(v)))  # ties to even, as ggml's float trick


def make_qkx2_quants(n, nmax, x, weights, rmin, rdelta, nstep):
    lo, hi = x[0], x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        lo, hi = min(lo, x[i]), max(hi, x[i])
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if lo > 0:
        lo = F(0)
    if hi == lo:
        return F(0), -lo, [0] * n
    iscale = F(nmax) / (hi - lo)
    scale = F(1) / iscale
    L = [max(0, min(nmax, nearest_int(iscale * (x[i] - lo)))) for i in range(n)]
    best = F(0)
    for i in range(n):
        diff = scale * F(L[i]) + lo - x[i]
        best += weights[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / (hi - lo)
        aux = [max(0, min(nmax, nearest_int(iscale * (x[i] - lo)))) for i in range(n)]
        sum_l = sum_l2 = sum_xl = F(0)
        for i in range(n):
            w, li = weights[i], F(aux[i])
            sum_l += w * li
            sum_l2 += w * li * li
            sum_xl += w * li * x[i]
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min = F(0)
                this_scale = sum_xl / sum_l2
            err = F(0)
            for i in range(n):
                diff = this_scale * F(aux[i]) + this_min - x[i]
                err += weights[i] * (diff * diff)
            if err < best:
                L, best, scale, lo = aux, err, this_scale, this_min
    return scale, -lo, L


def make_qx_quants(n, nmax, x):
    big, amax = F(0), F(0)
    for v in x:
        if abs(v) > amax:
            amax, big = abs(v), v
    if amax < F(1e-15):
        return F(0), [0] * n
    def fit(iscale):
        L, sumlx, suml2 = [], F(0), F(0)
        for v in x:
            li = max(-nmax, min(nmax - 1, nearest_int(iscale * v)))
            L.append(li + nmax)
            w = v * v
            sumlx += w * v * F(li)
            suml2 += w * F(li) * F(li)
        return L, sumlx, suml2
    L, sumlx, suml2 = fit(F(-nmax) / big)
    scale = sumlx / suml2 if suml2 else F(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        aux, sumlx, suml2 = fit(-(F(nmax) + F(0.1) * F(step)) / big)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            L, scale = aux, sumlx / suml2
            best = scale * sumlx
    return scale, L


def f16(v) -> tuple[bytes, F]:
    h = np.float16(v)
    return h.tobytes(), F(h)


def roundf(v) -> int:
    """C's roundf: ties away from zero (exact in float64 for a float32 input)."""
    a = abs(float(v))
    r = int(a) + (a - int(a) >= 0.5)
    return -r if v < 0 else r


def q8_0(x) -> bytes:
    d = max(abs(v) for v in x) / F(127)
    inv = F(1) / d if d else F(0)
    return f16(d)[0] + np.array([roundf(v * inv) for v in x], np.int8).tobytes()


def k_block(x, nmax, rmin, rdelta, nstep):
    scales, mins, L = [], [], []
    for j in range(8):
        sub = x[32 * j:32 * j + 32]
        av = np.sqrt(sum((v * v for v in sub), F(0)) / F(32), dtype=F)
        s, m, codes = make_qkx2_quants(32, nmax, sub, [av + abs(v) for v in sub], rmin, rdelta, nstep)
        scales.append(s), mins.append(m), L.append(codes)
    max_scale, max_min = max([F(0), *scales]), max([F(0), *mins])
    inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
    inv_min = F(63) / max_min if max_min > 0 else F(0)
    packed = [0] * 12
    ls_all, lm_all = [], []
    for j in range(8):
        ls = min(63, nearest_int(inv_scale * scales[j]) & 0xFF)
        lm = min(63, nearest_int(inv_min * mins[j]) & 0xFF)
        ls_all.append(ls), lm_all.append(lm)
        if j < 4:
            packed[j], packed[j + 4] = ls, lm
        else:
            packed[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
            packed[j - 4] |= (ls >> 4) << 6
            packed[j] |= (lm >> 4) << 6
    d_bytes, d = f16(max_scale / F(63))
    m_bytes, dmin = f16(max_min / F(63))
    for j in range(8):
        dj = d * F(ls_all[j])
        if not dj:
            continue
        dm = dmin * F(lm_all[j])
        L[j] = [max(0, min(nmax, nearest_int((v + dm) / dj))) for v in x[32 * j:32 * j + 32]]
    return d_bytes + m_bytes + bytes(packed), L


def q4_k(x) -> bytes:
    head, L = k_block(x, 15, -1.0, 0.1, 20)
    qs = [L[2 * c][i] | (L[2 * c + 1][i] << 4) for c in range(4) for i in range(32)]
    return head + bytes(qs)


def q5_k(x) -> bytes:
    head, L = k_block(x, 31, -0.5, 0.1, 15)
    qh = [sum(((L[j][i] >> 4) & 1) << j for j in range(8)) for i in range(32)]
    qs = [(L[2 * c][i] & 15) | ((L[2 * c + 1][i] & 15) << 4) for c in range(4) for i in range(32)]
    return head + bytes(qh) + bytes(qs)


def q6_k(x) -> bytes:
    scales, L = [], []
    for ib in range(16):
        s, codes = make_qx_quants(16, 32, x[16 * ib:16 * ib + 16])
        scales.append(s), L.extend(codes)
    max_scale, max_abs = F(0), F(0)
    for s in scales:
        if abs(s) > max_abs:
            max_abs, max_scale = abs(s), s
    if max_abs < F(1e-15):
        return bytes(210)
    iscale = F(-128) / max_scale
    d_bytes, d = f16(F(1) / iscale)
    sc = [min(127, nearest_int(iscale * s)) for s in scales]
    for j in range(16):
        dj = d * F(sc[j])
        if not dj:
            continue
        for i in range(16):
            L[16 * j + i] = max(-32, min(31, nearest_int(x[16 * j + i] / dj))) + 32
    ql, qh = [0] * 128, [0] * 64
    for h in range(2):
        o = 128 * h
        for i in range(32):
            ql[64 * h + i] = (L[o + i] & 0xF) | ((L[o + i + 64] & 0xF) << 4)
            ql[64 * h + i + 32] = (L[o + i + 32] & 0xF) | ((L[o + i + 96] & 0xF) << 4)
            qh[32 * h + i] = (L[o + i] >> 4) | ((L[o + i + 32] >> 4) << 2) | ((L[o + i + 64] >> 4) << 4) | \
                ((L[o + i + 96] >> 4) << 6)
    return bytes(ql) + bytes(qh) + np.array(sc, np.int8).tobytes() + d_bytes


QUANTIZE = {"q8_0": q8_0, "q4_k": q4_k, "q5_k": q5_k, "q6_k": q6_k}
