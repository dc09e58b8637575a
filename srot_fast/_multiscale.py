r"""Coarse-to-fine start of eps-scaling for the block-sparse backend (docs/DESIGN.md, Block-sparse passes).

A block-sparse pass drops nothing while eps is large against the data, so the first steps of eps-scaling
would run dense at O(N M). Here they run on cells instead:

1. **Cells.** The points of positive weight fall into the cells of one uniform grid of width ``w`` from the
   lower corner of both clouds' points of positive weight, chosen so that the larger cloud has about ``RATIO``
   points per cell (w = side / ceil((max(N, M) / RATIO)^(1/d))). A cell carries the sum of its weights,
   A_I = sum_{i in I} a_i, and their weighted centroid X_I. In a batch every problem has its own corner and
   cells, the width is the largest problem's, and the cell problems are padded to a common count with cells
   of weight zero.
2. **Coarse solve.** eps-scaling runs on the cells (the same penalties, mass and acceleration; the cell
   problem gets a coarse start of its own when it is still large) for every eps of the schedule with
   eps^(1/p) >= ``SWITCH`` w, the last one at least kept for the points, and is solved loosely (relative
   marginal error ``SCALE_TOL``) at the last coarse eps, eps_s.
3. **Lift.** One soft-min pass per side at eps_s, from the cells to the points, as in GeomLoss's multiscale
   mode: f_i = A_a(-eps_s LSE_J[log B_J + (G_J - C(x_i, Y_J) - V_J - u_i) / eps_s]), and g_j the same way
   from the row cells' F (for partial OT the dummy points are carried along).
4. **Fine eps-scaling.** The remaining eps values run on the points with the geometry's own (block-sparse)
   passes: a loose solve (``srot_fast._loop.loose_solve``, with its rules) at every intermediate eps, then the
   ordinary solve at the target eps from the lifted potentials, with the caller's tol, value_tol and the
   remaining update budget. The fixed point and the stopping test are those of a cold solve; only the
   start differs.

Cost offsets (soft SROT). The offsets of a cell are not constant. A cell gets the offset
U_I = -eps_s log sum_{i in I} (a_i / A_I) exp(-u_i / eps_s), the weighted soft-min of its points' offsets,
so that A_I exp(-U_I / eps_s) = sum_{i in I} a_i exp(-u_i / eps_s): at eps_s the cell weighs in every row
exactly what its points would at a common cost. The minimum of u would let one cheap point make a whole
cell of outliers look cheap; the mean would hide it.

Not for partial OT with cost offsets: there the lifted start left the solve at the target eps stuck (soft SROT
offsets, 2100 points, mass 0.7: marginal error 0.7 after 1000 updates and 0.25 after 5000, value 25 % low, where
the ordinary schedule converges in about 200 updates; the cause is not found), so such a solve takes the
ordinary schedule.
Used when the geometry's primitives are the block-sparse backend's (CPU tensors: the C++ passes; CUDA tensors:
the Triton ones; the cells are built in torch on the points' device), the points have d <= 3, ``tol`` is set
(``tol=None`` keeps GeomLoss's fixed schedule unchanged), no warm start is given, N M >= ``MIN_PAIRS``, every
problem has points of positive weight and the cell pairs are at most a quarter of the point pairs. Otherwise
:func:`alternating` and :func:`symmetric` are those of :mod:`srot_fast._loop`.
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
    """The cells of B clouds: ``of`` (B, N) int64 cell of each point in its problem (-1: zero weight, in no
    cell), ``pts`` (B, K, D) weighted centroids (the points' dtype), ``log_w`` (B, K) log of the summed weights
    (the log-weights' dtype). K is the largest problem's cell count; a problem with fewer cells is padded
    with cells of weight zero (log-weight -inf) at its first cell's centroid, neutral in every pass."""

    of: torch.Tensor
    pts: torch.Tensor
    log_w: torch.Tensor

    def offsets(self, u: Optional[torch.Tensor], log_a: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
        """(B, K) cell offsets U_I = -eps log sum_{i in I} (a_i / A_I) exp(-u_i / eps) for point offsets u
        (B, N) and log-weights log_a (B, N) (0 on padding cells); None without offsets."""
        if u is None:
            return None
        keep = self.of >= 0
        b, k = self.log_w.shape
        flat = keep.nonzero()[:, 0] * k + self.of[keep]  # cell index in the whole batch
        t = (log_a - u / eps)[keep].double()
        lse = _cell_lse(t, flat, b * k).view(b, k)
        out = -eps * (lse - self.log_w.double())
        return torch.where(self.log_w > -math.inf, out, torch.zeros_like(out)).to(u.dtype)


def _cell_lse(t: torch.Tensor, of: torch.Tensor, k: int) -> torch.Tensor:
    """(K,) log-sum-exp of t over each cell (-inf for a cell without points)."""
    top = torch.full((k,), -math.inf, dtype=t.dtype, device=t.device).scatter_reduce(0, of, t, "amax")
    s = torch.zeros(k, dtype=t.dtype, device=t.device).index_add_(0, of, (t - top[of]).exp())
    return top + s.log()


def _grid(x: torch.Tensor, y: torch.Tensor, log_a: torch.Tensor, log_b: torch.Tensor) -> tuple:
    """(lo (B, D), w) of the grids: each problem's lower corner of its points of positive weight, one common
    width (the largest problem's), with ``RATIO`` points of the larger cloud per cell on a full grid."""
    both = torch.cat([x, y], 1).double()
    keep = torch.cat([log_a, log_b], 1)[..., None] > -math.inf
    lo = both.masked_fill(~keep, math.inf).amin(1)
    side = float((both.masked_fill(~keep, -math.inf).amax(1) - lo).amax())
    d = x.shape[-1]
    per_side = math.ceil((max(x.shape[1], y.shape[1]) / RATIO) ** (1.0 / d))
    return lo, max(side, 1e-300) / max(per_side, 1)


def _cells(pts: torch.Tensor, log_w: torch.Tensor, lo: torch.Tensor, w: float) -> Optional[_Cells]:
    """The cells of pts (B, N, D) with log-weights log_w (B, N) on the grids (lo (B, D), w); None if a problem
    has no point of positive weight."""
    keep = log_w > -math.inf
    if not bool(keep.any(-1).all()):
        return None
    bsz, n, d = pts.shape
    p64 = pts.double()
    q = ((p64 - lo[:, None]) / w).floor().clamp_(0, 2**20).long()
    base = int(q[keep].max()) + 1  # <= cells per side + 1 (points of zero weight may lie anywhere)
    key = torch.arange(bsz, device=pts.device)[:, None].expand(bsz, n)
    for k in range(d):
        key = key * base + q[..., k]
    uniq, inv = torch.unique(key[keep], return_inverse=True)  # sorted: each problem's cells are contiguous
    owner = uniq // base**d                                    # (K_all,) problem of each cell
    counts = torch.bincount(owner, minlength=bsz)
    local = inv - (counts.cumsum(0) - counts)[owner[inv]]      # cell index within its problem
    k_cells = int(counts.max())
    rows = keep.nonzero()[:, 0]
    top = log_w.double().masked_fill(~keep, -math.inf).amax(-1)
    wt = (log_w[keep].double() - top[rows]).exp()  # weights rescaled by their problem's largest
    mass = p64.new_zeros(bsz, k_cells).index_put_((rows, local), wt, accumulate=True)
    centre = p64.new_zeros(bsz, k_cells, d).index_put_((rows, local), wt[:, None] * p64[keep], accumulate=True)
    real = torch.arange(k_cells, device=pts.device) < counts[:, None]
    centre = centre / mass.clamp_min(1e-300)[..., None]
    centre = torch.where(real[..., None], centre, centre[:, :1])
    log_mass = torch.where(real, mass.log() + top[:, None], torch.full_like(mass, -math.inf))
    of = torch.full((bsz, n), -1, dtype=torch.int64, device=pts.device)
    of[keep] = local
    return _Cells(of, centre.to(pts.dtype), log_mass.to(log_w.dtype))


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
    g, mass = real
    if mass is not None and (g.u is not None or g.v is not None):  # partial OT with offsets: module docstring
        return False
    return g.ops is blocksparse and 1 <= g.x.shape[-1] <= 3 and g.n * g.m >= MIN_PAIRS


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
    lo, w = _grid(real.x, real.y, la, lb)
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
    spent, passes, last = 1, 2, SCALE_CAP  # last: updates of the last loose solve (the coarse one: not easy)
    for eps in eps_list[k:-1]:  # fine eps-scaling, as in _loop.alternating
        ft = pen_a.aprox(geom.softmin_x(log_b + g / eps, eps), eps)
        gt = pen_b.aprox(geom.softmin_y(log_a + f / eps, eps), eps)
        f, g = 0.5 * (f + ft), 0.5 * (g + gt)
        spent, passes = spent + 1, passes + 2
        sub = _loop.loose_solve(geom, log_a, log_b, pen_a, pen_b, f, g, eps, eps_list[-1], last, max_iter - spent - 1,
                                check_every) if accelerate else None
        if sub is not None:
            last = int(sub.n_iter.max())
            f, g, passes, spent = sub.f, sub.g, passes + sub.passes, spent + last
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
    lo, w = _grid(geom.x, geom.x, log_a, log_a)
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
