"""Gradients of a solved OT value by the envelope theorem (docs/DESIGN.md, Gradients): the value is returned
by :class:`EnvelopeValue`, whose backward uses the saved plan marginals and one ``weighted_mean`` pass per
side instead of back-propagating through the Sinkhorn iterations. Exact to first order only: a gradient
built with ``create_graph=True`` refuses to be differentiated again (:func:`first_order_only`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .geometry import Geometry

__all__ = ["Saved", "EnvelopeValue", "first_order_only"]


class _NoSecondOrder(torch.autograd.Function):
    """Returns ``t``, recorded as a function of the inputs ``anchors``, with a backward that refuses:
    marks first-order gradients (built with create_graph=True) that must not be differentiated again."""

    @staticmethod
    def forward(ctx, t, *anchors):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(
            "srot_fast: second-order derivatives (double backward / Hessian-vector products) of an OT value are "
            "not supported; its gradients come from the envelope theorem, which is exact to first order only. "
            "Use torch.autograd.grad(..., create_graph=False), or finite differences of the gradient.")


@dataclass
class Saved:
    """What the envelope backward needs (batched, detached). Shapes for B problems. A field may be None where
    no input that reads it takes a gradient (grad_row, hx: x and u; grad_col, hy: y and v; ga: a; gb: b)."""

    geom: Geometry  # the points and the backend's primitives (with their options), or a sharded geometry
    eps: float
    grad_row: Optional[torch.Tensor]  # (B, N) pi 1 after an exact update of f for the final g
    grad_col: Optional[torch.Tensor]  # (B, M) pi^T 1 after an exact update of g for the final f
    ga: Optional[torch.Tensor]        # (B, N) d value / d a
    gb: Optional[torch.Tensor]        # (B, M) d value / d b
    hx: Optional[torch.Tensor]        # (B, M) column log-weights of the plan's row softmax
    hy: Optional[torch.Tensor]        # (B, N) row log-weights of the plan's column softmax


class EnvelopeValue(torch.autograd.Function):
    """Returns precomputed dual values (B,); its backward applies the envelope theorem."""

    @staticmethod
    def forward(ctx, value, saved: Saved, x, y, a, b, u, v):
        ctx.save_for_backward(x, y, a, b, u, v)
        ctx.saved = saved
        ctx.has_u, ctx.has_v = u is not None, v is not None
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        x, y, a, b, u, v = ctx.saved_tensors
        sv: Saved = ctx.saved
        need = ctx.needs_input_grad
        grad = grad.detach()
        gx = gy = gA = gB = gu = gv = None
        with torch.no_grad():
            gr = grad[:, None]
            if need[2]:
                gx = (gr * sv.grad_row)[..., None] * sv.geom.weighted_mean("x", sv.hx, sv.eps, "grad")
            if need[3]:
                gy = (gr * sv.grad_col)[..., None] * sv.geom.weighted_mean("y", sv.hy, sv.eps, "grad")
            gA = gr * sv.ga if need[4] else None
            gB = gr * sv.gb if need[5] else None
            gu = gr * sv.grad_row if need[6] and ctx.has_u else None
            gv = gr * sv.grad_col if need[7] and ctx.has_v else None
        return (None, None, *first_order_only([gx, gy, gA, gB, gu, gv], (x, y, a, b, u, v)))

    @staticmethod
    def jvp(ctx, *tangents):
        raise NotImplementedError(
            "srot_fast: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) of an OT value is not "
            "supported; use reverse mode (backward() or torch.autograd.grad)")


def first_order_only(grads: list, inputs: tuple) -> list:
    """``grads`` as they are, or, when a backward runs with create_graph=True (grad mode on), each one
    recorded as a function of the ``inputs`` that require grad through :class:`_NoSecondOrder`, so that
    differentiating it again raises instead of returning a wrong (zero) second derivative."""
    if not torch.is_grad_enabled():
        return grads
    anchors = [t for t in inputs if t is not None and t.requires_grad]
    return [None if g is None else _NoSecondOrder.apply(g, *anchors) for g in grads]
