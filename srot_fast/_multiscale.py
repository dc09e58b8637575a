r"""Coarse-to-fine start of eps-scaling for the block-sparse backend (docs/DESIGN.md, Block-sparse passes).

A block-sparse pass drops nothing while eps is large against the data, so the first steps of eps-scaling
would run dense at O(N M). Here they run on cells instead:

1. **Cells.** The points of positive weight fall into the cells of one uniform grid of width ``w`` over the
   bounding box of both clouds, chosen so that the larger cloud has about ``RATIO`` points per cell
   (w = side / ceil((max(N, M) / RATIO)^(1/d))). A cell carries the sum of its weights, A_I = sum_{i in I} a_i,
   and their weighted centroid X_I.
2. **Coarse solve.** eps-scaling runs on the cells (the same penalties, mass and acceleration; the cell
   problem gets a coarse start of its own when it is still large) for every eps of the schedule with
   eps^(1/p) >= ``SWITCH`` w, the last one at least kept for the points, and is solved loosely (relative
   marginal error ``SCALE_TOL``) at the last coarse eps, eps_s.
3. **Lift.** One soft-min pass per side at eps_s, from the cells to the points, as in GeomLoss's multiscale
   mode: f_i = A_a(-eps_s LSE_J[log B_J + (G_J - C(x_i, Y_J) - V_J - u_i) / eps_s]), and g_j the same way
   from the row cells' F (for partial OT the dummy points are carried along).
4. **Fine eps-scaling.** The remaining eps values run on the points with the geometry's own (block-sparse)
   passes: a loose solve (``SCALE_TOL``, at most ``SCALE_CAP`` updates) at every intermediate eps, then the
   ordinary solve at the target eps from the lifted potentials, with the caller's tol, value_tol and the
   remaining update budget. The fixed point and the stopping test are those of a cold solve; only the
   start differs.

Cost offsets (soft SROT). The offsets of a cell are not constant. A cell gets the offset
U_I = -eps_s log sum_{i in I} (a_i / A_I) exp(-u_i / eps_s), the weighted soft-min of its points' offsets,
so that A_I exp(-U_I / eps_s) = sum_{i in I} a_i exp(-u_i / eps_s): at eps_s the cell weighs in every row
exactly what its points would at a common cost. The minimum of u would let one cheap point make a whole
cell of outliers look cheap; the mean would hide it.

Used when the geometry's primitives are the block-sparse backend's (CPU tensors: the C++ passes; CUDA tensors:
the Triton ones; the cells are built in torch on the points' device), the points have d <= 3, one problem
(a batch takes the ordinary schedule), ``tol`` is set (``tol=None`` keeps GeomLoss's fixed schedule
unchanged), no warm start is given, N M >= ``MIN_PAIRS`` and the cell pairs are at most a quarter of the
point pairs. Otherwise :func:`alternating` and :func:`symmetric` are those of :mod:`srot_fast._loop`.
``n_iter`` and ``passes`` of the result count the updates and passes on the points (the lift counts as one
update of two passes), not those on the cells.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from . import _loop
from .geometry import Geometry, PartialGeometry

__all__ = ["alternating", "symmetric", "RATIO", "SWITCH", "MIN_PAIRS"]

RATIO = 4           # points of the larger cloud per cell (on average over a full grid)
SWITCH = 1.0        # the cells take every eps with eps^(1/p) >= SWITCH x the cell width
MIN_PAIRS = 1 << 22  # N M below this: the ordinary schedule (the dense passes are cheap)
SCALE_TOL, SCALE_CAP = _loop.SCALE_TOL, _loop.SCALE_CAP


@dataclasses.dataclass
class _Cells:
    """The cells of one cloud: ``of`` (N,) int64 cell of each point (-1: zero weight, in no cell), ``pts``
    (1, K, D) weighted centroids (the points' dtype), ``log_w`` (1, K) log of the summed weights (the
    log-weights' dtype)."""

    of: torch.Tensor
    pts: torch.Tensor
    log_w: torch.Tensor

    def offsets(self, u: Optional[torch.Tensor], log_a: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
        """(1, K) cell offsets U_I = -eps log sum_{i in I} (a_i / A_I) exp(-u_i / eps) for point offsets u
        (1, N) and log-weights log_a (1, N); None without offsets."""
        if u is None:
            return None
        keep = self.of >= 0
        t = (log_a[0] - u[0] / eps)[keep].double()
        return (-eps * (_cell_lse(t, self.of[keep], self.pts.shape[1]) - self.log_w[0].double()))[None].to(u.dtype)


def _cell_lse(t: torch.Tensor, of: torch.Tensor, k: int) -> torch.Tensor:
    """(K,) log-sum-exp of t over each cell."""
    top = torch.full((k,), -math.inf, dtype=t.dtype, device=t.device).scatter_reduce(0, of, t, "amax")
    s = torch.zeros(k, dtype=t.dtype, device=t.device).index_add_(0, of, (t - top[of]).exp())
    return top + s.log()


def _grid(x: torch.Tensor, y: torch.Tensor) -> tuple:
    """(lo (D,), w) of the common grid: ``RATIO`` points of the larger cloud per cell on a full grid."""
    both = torch.cat([x[0], y[0]]).double()
    lo = both.amin(0)
    side = float((both.amax(0) - lo).max())
    d = x.shape[-1]
    per_side = math.ceil((max(x.shape[1], y.shape[1]) / RATIO) ** (1.0 / d))
    return lo, max(side, 1e-300) / max(per_side, 1)


def _cells(pts: torch.Tensor, log_w: torch.Tensor, lo: torch.Tensor, w: float) -> Optional[_Cells]:
    """The cells of pts (1, N, D) with log-weights log_w (1, N); None if no point has positive weight."""
    keep = log_w[0] > -math.inf
    if not bool(keep.any()):
        return None
    p64 = pts[0].double()
    q = ((p64 - lo) / w).floor().clamp_(0, 2**20).long()
    key = torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    for k in range(q.shape[1]):
        key = key * (2**21) + q[:, k]
    _, inv = torch.unique(key[keep], return_inverse=True)
    k_cells = int(inv.max()) + 1
    lw = log_w[0][keep].double()
    top = lw.max()
    wt = (lw - top).exp()  # weights rescaled by their largest (no underflow of tiny weights' sums)
    mass = p64.new_zeros(k_cells).index_add_(0, inv, wt)
    centre = p64.new_zeros(k_cells, pts.shape[-1]).index_add_(0, inv, wt[:, None] * p64[keep])
    of = torch.full((pts.shape[1],), -1, dtype=torch.int64, device=pts.device)
    of[keep] = inv
    return _Cells(of, (centre / mass[:, None]).to(pts.dtype)[None], (mass.log() + top).to(log_w.dtype)[None])


def _real(geom):
    """The plain geometry under ``geom`` and the partial mass (None when not partial), or None when the coarse
    start does not apply to this geometry type (sharded or other)."""
    if type(geom) is PartialGeometry and type(geom.real) is Geometry:
        return geom.real, geom.mass
    if type(geom) is Geometry:
        return geom, None
    return None


def _applies(geom, eps_list, tol, init) -> bool:
    from .kernels import blocksparse

    real = _real(geom)
    if real is None or tol is None or init is not None or len(eps_list) < 2:
        return False
    g = real[0]
    return g.ops is blocksparse and g.batch == 1 and 1 <= g.x.shape[-1] <= 3 and g.n * g.m >= MIN_PAIRS


def _coarse_len(eps_list, p: int, w: float) -> int:
    """How many leading eps of the schedule the cells take (the last eps stays for the points)."""
    k = sum(1 for e in eps_list if e ** (1.0 / p) >= SWITCH * w)
    return min(k, len(eps_list) - 1)


def _split(log_t: torch.Tensor, partial: bool):
    """(real log-weights, dummy log-weight or None)."""
    return (log_t[:, :-1], log_t[:, -1:]) if partial else (log_t, None)


def _join(t: torch.Tensor, dummy: Optional[torch.Tensor]) -> torch.Tensor:
    return t if dummy is None else torch.cat([t, dummy], -1)


def _wrap(geom: Geometry, mass):
    return geom if mass is None else PartialGeometry(geom, mass)


def alternating(geom, log_a, log_b, pen_a, pen_b, eps_list, tol, max_iter, init=None, accelerate=True,
                check_every=None, **kw) -> _loop.Solution:
    """:func:`srot_fast._loop.alternating` (same arguments and result) with the coarse-to-fine start of the
    module docstring where it applies."""
    plain = (geom, log_a, log_b, pen_a, pen_b, eps_list, tol, max_iter, init, accelerate, check_every)
    if not _applies(geom, eps_list, tol, init):
        return _loop.alternating(*plain, **kw)
    real, mass = _real(geom)
    partial = mass is not None
    eps_list = _loop.fit_schedule(eps_list, max(max_iter, 1))
    la, la_dummy = _split(log_a, partial)
    lb, lb_dummy = _split(log_b, partial)
    lo, w = _grid(real.x, real.y)
    k = _coarse_len(eps_list, real.p, w)
    cx, cy = _cells(real.x, la, lo, w), _cells(real.y, lb, lo, w)
    if k < 1 or cx is None or cy is None or 4 * cx.pts.shape[1] * cy.pts.shape[1] > real.n * real.m:
        return _loop.alternating(*plain, **kw)
    eps_s = eps_list[k - 1]
    ux, vy = cx.offsets(real.u, la, eps_s), cy.offsets(real.v, lb, eps_s)
    coarse = _wrap(Geometry(real.ops, cx.pts, cy.pts, real.p, ux, vy, real.options), mass)
    sol = alternating(coarse, _join(cx.log_w, la_dummy), _join(cy.log_w, lb_dummy), pen_a, pen_b,
                      eps_list[:k], SCALE_TOL, max_iter, None, accelerate, check_every, need_t=False)
    # lift: one soft-min pass per side at eps_s, from the cells to the points
    to_x = _wrap(Geometry(real.ops, real.x, cy.pts, real.p, real.u, vy, real.options), mass)
    to_y = _wrap(Geometry(real.ops, cx.pts, real.y, real.p, ux, real.v, real.options), mass)
    f = pen_a.aprox(to_x.softmin_x(_join(cy.log_w, lb_dummy) + sol.g / eps_s, eps_s), eps_s)
    g = pen_b.aprox(to_y.softmin_y(_join(cx.log_w, la_dummy) + sol.f / eps_s, eps_s), eps_s)
    spent, passes = 1, 2
    for eps in eps_list[k:-1]:  # fine eps-scaling, as in _loop.alternating
        ft = pen_a.aprox(geom.softmin_x(log_b + g / eps, eps), eps)
        gt = pen_b.aprox(geom.softmin_y(log_a + f / eps, eps), eps)
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
        spent, passes = spent + 1, passes + 2
        left = max_iter - spent - 1
        if accelerate and left > 0:
            sub = _loop.alternating(geom, log_a, log_b, pen_a, pen_b, [eps], SCALE_TOL, min(SCALE_CAP, left),
                                    (f, g), accelerate, check_every, need_t=False)
            f, g, passes, spent = sub.f, sub.g, passes + sub.passes, spent + int(sub.n_iter.max())
    final = _loop.alternating(geom, log_a, log_b, pen_a, pen_b, eps_list[-1:], tol, max(max_iter - spent, 0),
                              (f, g), accelerate, check_every, **kw)
    return dataclasses.replace(final, n_iter=final.n_iter + spent, passes=final.passes + passes)


def symmetric(geom, log_a, pen, eps_list, tol, max_iter, init=None, check_every=None,
              **kw) -> _loop.Solution:
    """:func:`srot_fast._loop.symmetric` (self-transport, same arguments and result) with the coarse-to-fine
    start of the module docstring where it applies."""
    plain = (geom, log_a, pen, eps_list, tol, max_iter, init, check_every)
    if not _applies(geom, eps_list, tol, init) or _real(geom)[1] is not None:
        return _loop.symmetric(*plain, **kw)
    eps_list = _loop.fit_schedule(eps_list, max(max_iter, 1))
    lo, w = _grid(geom.x, geom.x)
    k = _coarse_len(eps_list, geom.p, w)
    cx = _cells(geom.x, log_a, lo, w)
    if k < 1 or cx is None or 4 * cx.pts.shape[1] ** 2 > geom.n * geom.m:
        return _loop.symmetric(*plain, **kw)
    eps_s = eps_list[k - 1]
    ux = cx.offsets(geom.u, log_a, eps_s)
    coarse = Geometry(geom.ops, cx.pts, cx.pts, geom.p, ux, ux, geom.options)
    sol = symmetric(coarse, cx.log_w, pen, eps_list[:k], SCALE_TOL, max_iter, None, check_every)
    to_x = Geometry(geom.ops, geom.x, cx.pts, geom.p, geom.u, ux, geom.options)
    f = pen.aprox(to_x.softmin_x(cx.log_w + sol.f / eps_s, eps_s), eps_s)
    spent, passes = 1, 1
    for eps in eps_list[k:-1]:
        sub = _loop.symmetric(geom, log_a, pen, [eps], SCALE_TOL, min(SCALE_CAP, max(max_iter - spent - 1, 0)),
                              (f, f), check_every)
        f, passes, spent = sub.f, passes + sub.passes, spent + int(sub.n_iter.max())
    final = _loop.symmetric(geom, log_a, pen, eps_list[-1:], tol, max(max_iter - spent, 0), (f, f), check_every,
                            **kw)
    return dataclasses.replace(final, n_iter=final.n_iter + spent, passes=final.passes + passes)
