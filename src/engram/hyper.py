"""mHC: manifold-constrained hyper-connections (arXiv 2512.24880) with G = hc_mult residual streams.

    x_{l+1} = H_res x_l + H_post^T F(H_pre x_l),      x_l: (B, T, G, D)   (D: hidden size)

Coefficients come from the RMS-normed flattened streams x' (B, T, G*D):
    H~ = alpha * (x' phi) + b,  H_pre = sigmoid(H~_pre),  H_post = 2 sigmoid(H~_post),
    H_res = SinkhornKnopp(exp(H~_res))   (20 alternating column/row normalizations).
alpha starts at 0.01 so every layer starts near its static bias: H_pre = 1/G (the layer reads
the mean of the streams), H_post = 1 (it writes to every stream) and H_res = Sinkhorn(exp(I)) (diagonal
~0.48 for G = 4, off-diagonal ~0.17).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from ._fastsinkhorn import available as _fused_available
from ._fastsinkhorn import backward as _fused_backward
from ._fastsinkhorn import forward as _fused_forward


def sinkhorn_knopp(logits: torch.Tensor, iters: int = 20) -> torch.Tensor:
    """exp(logits) (..., n, n) -> approximately doubly stochastic, alternating column and row normalization."""
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))  # shift for stability; cancels out
    for _ in range(iters):
        m = m / m.sum(dim=-2, keepdim=True)  # columns
        m = m / m.sum(dim=-1, keepdim=True)  # rows
    return m


class _FusedSinkhorn(torch.autograd.Function):
    """`sinkhorn_knopp` as one numba kernel each way (CPU, float32); same unrolled math and gradient."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iters: int) -> torch.Tensor:
        n = logits.shape[-1]
        out, its = _fused_forward(logits.detach().reshape(-1, n, n).contiguous().numpy(), iters)
        ctx.its, ctx.shape = its, logits.shape
        return torch.from_numpy(out).view(logits.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = ctx.shape[-1]
        gin = _fused_backward(ctx.its, grad.detach().float().reshape(-1, n, n).contiguous().numpy())
        return torch.from_numpy(gin).view(ctx.shape), None


def sinkhorn(logits: torch.Tensor, iters: int = 20, fused: bool = True) -> torch.Tensor:
    """`sinkhorn_knopp`, through the fused numba kernels when possible (CPU float32, `engram-torch[fast]`)."""
    if fused and logits.device.type == "cpu" and logits.dtype == torch.float32:
        if _fused_available():
            return _FusedSinkhorn.apply(logits, iters)
    return sinkhorn_knopp(logits, iters)


class HyperConnection(nn.Module):
    """Wraps one sublayer F (attention or FFN) with n-stream mHC mixing."""

    def __init__(self, hidden_size: int, n: int, sinkhorn_iters: int = 20, alpha_init: float = 0.01):
        super().__init__()
        self.n, self.sinkhorn_iters = n, sinkhorn_iters
        self.norm = nn.RMSNorm(n * hidden_size, eps=1e-6)
        self.phi = nn.Linear(n * hidden_size, n + n + n * n, bias=False)  # [pre (n); post (n); res (n*n)]
        nn.init.normal_(self.phi.weight, std=1.0 / math.sqrt(n * hidden_size))
        self.alpha_init = alpha_init
        self.alpha = nn.Parameter(torch.full((3,), alpha_init))
        self.bias = nn.Parameter(self.initial_bias())

    def initial_bias(self) -> torch.Tensor:
        """[pre (n); post (n); res (n*n)] logits at init: pre at 1/n after the sigmoid, res a mild identity."""
        n = self.n
        b_pre = torch.full((n,), math.log(1.0 / n) - math.log1p(-1.0 / n)) if n > 1 else torch.full((1,), 4.0)
        b_res = torch.eye(n)  # mild identity preference; a stronger one slows Sinkhorn past 20 iterations
        return torch.cat([b_pre, torch.zeros(n), b_res.flatten()])

    def coefficients(self, x: torch.Tensor):
        """x (B, T, G, D) -> H_pre (B, T, G), H_post (B, T, G), H_res (B, T, G, G)."""
        B, T, G, D = x.shape
        h = self.phi(self.norm(x.reshape(B, T, G * D)))  # (B, T, 2G + G^2)
        a = torch.cat([self.alpha[0].expand(G), self.alpha[1].expand(G), self.alpha[2].expand(G * G)])
        h = a * h + self.bias
        h_pre = torch.sigmoid(h[..., :G])
        h_post = 2 * torch.sigmoid(h[..., G:2 * G])
        h_res = sinkhorn(h[..., 2 * G:].reshape(B, T, G, G), self.sinkhorn_iters)
        return h_pre, h_post, h_res

    def forward(self, x: torch.Tensor, fn) -> torch.Tensor:
        h_pre, h_post, h_res = self.coefficients(x)
        layer_in = torch.einsum("btn,btnc->btc", h_pre, x)  # (B, T, D)
        layer_out = fn(layer_in)  # (B, T, D)
        mixed = torch.einsum("btij,btjc->btic", h_res, x)  # (B, T, G, D)
        return mixed + h_post.unsqueeze(-1) * layer_out.unsqueeze(2)
