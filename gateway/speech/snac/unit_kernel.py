"""The Triton source of `kernels.residual_unit`, imported only where the kernels run (`kernels._unit_kernel`).

Triton's interpreter (the tests on a CPU) needs the kernel decorated under TRITON_INTERPRET (the tests reload this
module) and only Triton's built-ins inside it: the library's own helpers (`tl.zeros`, ...) are compiled or
interpreted as triton was first imported, which in a test session is not known."""


import triton
import triton.language as tl


@triton.jit
def unit_kernel(joined_ptr, sj_b, sj_c, x_ptr, sx_b, sx_c, xh_ptr, sxh_b, sxh_c, out_ptr, so_b, so_c,
                alpha2_ptr, dw_w_ptr, dw_b_ptr, pw_w_ptr, pw_b_ptr, frame_ptr, end_ptr,
                length, per_frame, delay,
                C: tl.constexpr, K: tl.constexpr, DIL: tl.constexpr,  # noqa: N803 - Triton's style
                MASKED: tl.constexpr, HAS_DW_BIAS: tl.constexpr, HAS_PW_BIAS: tl.constexpr,  # noqa: N803
                LOW_PRECISION: tl.constexpr,  # noqa: N803
                batch, BLOCK_R: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_CO: tl.constexpr,  # noqa: N803
                BLOCK_CI: tl.constexpr):  # noqa: N803
    # A tile's columns: BLOCK_R streams x BLOCK_T samples (several short streams fill one tensor-core tile).
    col = tl.arange(0, BLOCK_R * BLOCK_T)
    row = tl.program_id(0) * BLOCK_R + col // BLOCK_T
    t = tl.program_id(1) * BLOCK_T + col % BLOCK_T
    co = tl.program_id(2) * BLOCK_CO + tl.arange(0, BLOCK_CO)
    t_ok = (t < length) & (row < batch)
    row = row.to(tl.int64)
    delayed = (K - 1) // 2 * DIL  # x history kept for the residual skip: the conv's padding
    acc = tl.full((BLOCK_CO, BLOCK_R * BLOCK_T), 0.0, tl.float32)
    joined_rows = joined_ptr + row * sj_b
    for ci0 in range(0, C, BLOCK_CI):
        ci = ci0 + tl.arange(0, BLOCK_CI)
        h = tl.full((BLOCK_CI, BLOCK_R * BLOCK_T), 0.0, tl.float32)
        for k in tl.static_range(K):
            tap = tl.load(joined_rows[None, :] + ci[:, None] * sj_c + (t + k * DIL)[None, :], mask=t_ok[None, :],
                          other=0.0).to(tl.float32)
            h += tap * tl.load(dw_w_ptr + ci * K + k).to(tl.float32)[:, None]
        if HAS_DW_BIAS:
            h += tl.load(dw_b_ptr + ci).to(tl.float32)[:, None]
        a2 = tl.load(alpha2_ptr + ci).to(tl.float32)[:, None]
        if LOW_PRECISION:  # the SFU's sine: error ~1e-6, far below bfloat16's rounding
            s2 = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [a2 * h], dtype=tl.float32,
                                           is_pure=True, pack=1)
        else:
            s2 = tl.sin(a2 * h)
        h = h + (1.0 / (a2 + 1e-9)) * s2 * s2
        w_pw = tl.load(pw_w_ptr + co[:, None] * C + ci[None, :])
        if LOW_PRECISION:
            acc += tl.dot(w_pw, h.to(w_pw.dtype))
        else:
            acc += tl.dot(w_pw.to(tl.float32), h, input_precision="ieee")
    if HAS_PW_BIAS:
        acc += tl.load(pw_b_ptr + co).to(tl.float32)[:, None]
    # The residual skip: x delayed by the padding, its first samples from the state's x history.
    early = t < delayed
    skip_old = tl.load(xh_ptr + (row * sxh_b)[None, :] + co[:, None] * sxh_c + t[None, :],
                       mask=(early & t_ok)[None, :], other=0.0).to(tl.float32)
    skip_new = tl.load(x_ptr + (row * sx_b)[None, :] + co[:, None] * sx_c + (t - delayed)[None, :],
                       mask=((~early) & t_ok)[None, :], other=0.0).to(tl.float32)
    out = acc + tl.where(early[None, :], skip_old, skip_new)
    if MASKED:  # the full decode's zero padding: 0 outside [0, end) at this layer's rate
        pos = tl.load(frame_ptr + row, mask=t_ok, other=0) * per_frame - delay + t
        valid = (pos >= 0) & (pos < tl.load(end_ptr + row, mask=t_ok, other=0) * per_frame)
        out = tl.where(valid[None, :], out, 0.0)
    tl.store(out_ptr + (row * so_b)[None, :] + co[:, None] * so_c + t[None, :], out.to(out_ptr.dtype.element_ty),
             mask=t_ok[None, :])
