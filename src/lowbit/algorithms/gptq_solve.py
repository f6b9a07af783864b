"""GPTQ's column loop over one or several weights of the same input width (pure function).

Each part p is (W_p [out_p, in], -Ub_p [in, in]) with Ub = diag(U)^-1 U for U the upper
Cholesky factor of the part's damped inverse Hessian (the effective scales of all rows come
transposed, [in, rows], so that a column's are one contiguous row): the
update of column k by column j is then w_k -= (w_j - q_j) * Ub[j, k], and the lazy block
updates take the differences w_j - q_j as they are. The parts' rows are stacked (rows are
independent in GPTQ) and transposed to [in, rows], so that a column is one contiguous row and
the per-column divide, rounding and error run once for every part; only the rank-1 update
inside a sub-block and the block updates are per part (each part has its own Hessian).
Stacking changes nothing but float32 summation order.

Device-generic: the loop runs where the weights are (a GPU's weights are solved on the GPU by
the torch loop; the C sub-block takes CPU tensors only). A GPU's matrix products sum in another
order than the CPU's, so its codes can differ from the CPU's in the last bit of a weight's error
and hence in an occasional rounding choice (bench/gpu/gpu_calibrate.py measures how many).

Inside a sub-block of ``SUB`` columns the loop runs in C when the kernel setting allows the native
implementation (lowbit.kernels.rounding.gptq_sub_block)
(``lb_gptq_sub``: the same operations in the same order, bit-identical; the torch loop costs
~10 eager operations per column, profiled in bench/peers/RESULTS.md, "gptq-fast"); the block updates
stay torch matrix products.

Per column j: y = w_j / divisor (divisor: the effective scale, 1 where it is 0), q = nearest
grid value of y (``lowbit.kernels.rounding``), e = w_j - q * eff (a zero scale gives q * 0 = 0:
e = w_j), updates. Row j of the working copy is final once column j is done (only later
rows are updated), so the solved weights are Q = W - E, block by block.
"""

from __future__ import annotations

import torch

from lowbit.kernels.rounding import column_rounder, gptq_sub_block

# columns updated one by one inside a block before a matrix update of the rest of the block:
# keeps the per-column updates small (single-threaded, cache-resident); the result differs
# from a column-by-column update of the whole block only in float32 summation order
SUB = 16


def solve_columns(parts: list[tuple[torch.Tensor, torch.Tensor]], eff_t: torch.Tensor, div_t: torch.Tensor,
                  fmt, block_size: int) -> list[torch.Tensor]:
    """The GPTQ-rounded (dequantized) weights [out_p, in] of each part (W_p, -Ub_p); ``eff_t`` and
    ``div_t`` [in, rows]: the effective scales and divisors of the stacked rows, transposed.
    Each sub-block's column loop runs in C where the kernel setting allows (the same operations in
    the same order: bit-identical; the torch loop costs ~10 eager operations per column)."""
    in_f = parts[0][0].shape[1]
    rows = sum(w.shape[0] for w, _ in parts)
    device = parts[0][0].device
    Wt = torch.empty(in_f, rows, dtype=torch.float32, device=device)  # [in, rows]
    spans, r0 = [], 0
    for w, _ in parts:
        spans.append((r0, r0 + w.shape[0]))
        Wt[:, r0:r0 + w.shape[0]].copy_(w.t())
        r0 += w.shape[0]
    us = [u.contiguous() for _, u in parts]
    native_sub = gptq_sub_block(fmt, device)
    sub = None if native_sub is None else native_sub[0]
    if sub is not None:
        # per-channel scales come as one row expanded over the columns (stride 0): kept so
        div_c, eff_c = (t if t.stride() == (0, 1) else t.contiguous() for t in (div_t, eff_t))
        ds = 0 if div_c.stride(0) == 0 and eff_c.stride(0) == 0 else rows
        if ds:
            div_c, eff_c = div_c.contiguous(), eff_c.contiguous()
        nat_args = (len(parts), torch.tensor([a for a, _ in spans]), torch.tensor([b for _, b in spans]),
                    torch.tensor([u.data_ptr() for u in us]))
        nat_ptrs = tuple(t.data_ptr() for t in nat_args[1:])
        rnd = native_sub[1]
        step = rows * 4  # bytes per float32 row of [in, rows]
    else:
        div_rows, eff_rows = div_t.contiguous().unbind(0), eff_t.contiguous().unbind(0)
        y, round_ = column_rounder(fmt, Wt.shape[1], device)

    for i1 in range(0, in_f, block_size):
        i2 = min(i1 + block_size, in_f)
        n = i2 - i1
        W1 = Wt[i1:i2]
        E1 = torch.empty_like(W1)
        # per part: its columns of the block, of its errors (as rows) and its block of -Ub
        blocks = [(W1[:, a:b], E1[:, a:b], u[i1:i2, i1:i2]) for (a, b), u in zip(spans, us)]
        if sub is None:
            w_rows, e_rows = W1.unbind(0), E1.unbind(0)
            rank1 = [(wp, up, e_rows if len(parts) == 1 else ep.unbind(0)) for wp, ep, up in blocks]
        for s1 in range(0, n, SUB):
            s2 = min(s1 + SUB, n)
            if sub is not None:  # the loop below, in C
                j = i1 + s1
                sub(W1.data_ptr() + s1 * step, E1.data_ptr() + s1 * step, div_c.data_ptr() + j * ds * 4,
                    eff_c.data_ptr() + j * ds * 4, ds, s2 - s1, rows, nat_args[0], *nat_ptrs, in_f, j, *rnd)
            else:
                for i in range(s1, s2):
                    j = i1 + i
                    w = w_rows[i]
                    torch.div(w, div_rows[j], out=y)
                    round_()
                    torch.addcmul(w, y, eff_rows[j], value=-1.0, out=e_rows[i])
                    if i + 1 < s2:
                        for wp, up, ep_rows in rank1:
                            wp[i + 1:s2].addr_(up[i, i + 1:s2], ep_rows[i])
            if s2 < n:
                for wp, ep, up in blocks:
                    wp[s2:].addmm_(up[s1:s2, s2:].t(), ep[s1:s2])
        if i2 < in_f:
            for (a, b), u, (_, ep, _) in zip(spans, us, blocks):
                Wt[i2:, a:b].addmm_(u[i1:i2, i2:].t(), ep)
        W1.sub_(E1)                                                    # Q = W - E
    return [Wt[:, a:b].t().contiguous() for a, b in spans]
