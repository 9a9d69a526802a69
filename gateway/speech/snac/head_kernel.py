"""The Triton source of `kernels.block_head`, imported only where the kernels run (`kernels._head_kernel`).

As `unit_kernel`: decorated under TRITON_INTERPRET when the tests reload this module, and only Triton's built-ins
inside the kernel."""


import triton
import triton.language as tl


@triton.jit
def head_kernel(x_ptr, sx_b, sx_c, xh_ptr, sxh_b, sxh_c, out_ptr, so_b, so_c, alpha_ptr, phases_ptr, bias_ptr,
                length, batch,
                C_IN: tl.constexpr, C_OUT: tl.constexpr, S: tl.constexpr,  # noqa: N803 - Triton's style
                HAS_BIAS: tl.constexpr, LOW_PRECISION: tl.constexpr,  # noqa: N803
                BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr,  # noqa: N803
                BLOCK_CI: tl.constexpr):  # noqa: N803
    # Input columns: BLOCK_R streams x BLOCK_T new samples; rows: BLOCK_O output channels x S phases, row
    # o * S + r holding output o at phase r (output sample t * S + r of new input t).
    n: tl.constexpr = BLOCK_R * BLOCK_T
    m: tl.constexpr = BLOCK_O * S
    col = tl.arange(0, n)
    row = tl.program_id(0) * BLOCK_R + col // BLOCK_T
    t = tl.program_id(1) * BLOCK_T + col % BLOCK_T
    t_ok = (t < length) & (row < batch)
    first = t == 0  # its previous input is the kept one (already through the Snake)
    row = row.to(tl.int64)
    x_rows = x_ptr + row * sx_b
    kept_rows = xh_ptr + row * sxh_b
    phase_rows = tl.program_id(2) * m + tl.arange(0, m)
    acc = tl.full((m, n), 0.0, tl.float32)
    for ci0 in range(0, C_IN, BLOCK_CI):
        ci = ci0 + tl.arange(0, BLOCK_CI)
        alpha = tl.load(alpha_ptr + ci).to(tl.float32)[:, None]
        inv_alpha = 1.0 / (alpha + 1e-9)
        cur = tl.load(x_rows[None, :] + ci[:, None] * sx_c + t[None, :], mask=t_ok[None, :],
                      other=0.0).to(tl.float32)
        prev = tl.load(x_rows[None, :] + ci[:, None] * sx_c + (t - 1)[None, :], mask=(t_ok & ~first)[None, :],
                       other=0.0).to(tl.float32)
        if LOW_PRECISION:  # the SFU's sine: error ~1e-6, far below bfloat16's rounding
            sin_cur = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [alpha * cur], dtype=tl.float32,
                                                is_pure=True, pack=1)
            sin_prev = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [alpha * prev],
                                                 dtype=tl.float32, is_pure=True, pack=1)
        else:
            sin_cur = tl.sin(alpha * cur)
            sin_prev = tl.sin(alpha * prev)
        cur = cur + inv_alpha * sin_cur * sin_cur
        prev = prev + inv_alpha * sin_prev * sin_prev
        kept = tl.load(kept_rows[None, :] + ci[:, None] * sxh_c, mask=(t_ok & first)[None, :],
                       other=0.0).to(tl.float32)
        prev = tl.where(first[None, :], kept, prev)
        w_cur = tl.load(phases_ptr + phase_rows[:, None] * C_IN + ci[None, :])
        w_prev = tl.load(phases_ptr + (S * C_OUT + phase_rows)[:, None] * C_IN + ci[None, :])
        if LOW_PRECISION:
            acc += tl.dot(w_cur, cur.to(w_cur.dtype))
            acc += tl.dot(w_prev, prev.to(w_prev.dtype))
        else:
            acc += tl.dot(w_cur.to(tl.float32), cur, input_precision="ieee")
            acc += tl.dot(w_prev.to(tl.float32), prev, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + phase_rows // S).to(tl.float32)[:, None]
    # Phases side by side: [o, r, column] -> [o, column, r] -> [o, column * S + r], a stream's outputs contiguous.
    out = tl.reshape(tl.permute(tl.reshape(acc, (BLOCK_O, S, n)), (0, 2, 1)), (BLOCK_O, n * S))
    o = tl.program_id(2) * BLOCK_O + tl.arange(0, BLOCK_O)
    out_col = tl.arange(0, n * S)
    in_col = out_col // S
    out_row = (tl.program_id(0) * BLOCK_R + in_col // BLOCK_T)
    out_t = (tl.program_id(1) * BLOCK_T + in_col % BLOCK_T) * S + out_col % S
    ok = (out_t < length * S) & (out_row < batch)
    tl.store(out_ptr + (out_row.to(tl.int64) * so_b)[None, :] + o[:, None] * so_c + out_t[None, :],
             out.to(out_ptr.dtype.element_ty), mask=ok[None, :])
