"""The numerics gate of ``kernels: auto``: what a candidate must get right before it is timed.

Each case gets inputs drawn for it (``make_problem``: rows of BERT-like lengths,
``case_lengths``). Dropout off, a candidate's forward output and the gradient of every input are
compared with the fp32 math reference (``reference.py``'s ``*_math`` twins, ``oracle_for``) on
the same rounded inputs. It passes when, for every tensor, its error is at most twice the
baseline's own error in the same dtype plus a floor (``FLOORS``), as in ``tests/ops``. Error
(``rel_err``): max |a - e| / max(max |e|, 1e-2). Attention outputs are compared at real query
positions (padded positions are never read by the model).

With dropout the candidate must also apply it (the output changes), stay finite forward and
backward, drop a binomial fraction p, and use one mask in the forward and the backward
(``dropout_problem``). The bounds are applied by the planning (``selection.decide_case``).

The windowed ops (``WINDOW_OPS``) are judged against their reference twins with the case's
window; an inference case (``backward`` False) on its output alone. Their baseline, the reference
twin, computes in fp32 and rounds once, so in bf16/fp16 its error is no yardstick for a correct
kernel: the bound there is twice the larger of its error and that of an unfused kernel in the
case's dtype (``unfused_twin``: Q K^T and P V in that dtype, the softmax in fp32). With dropout
they must apply it and stay finite (the mask-reading checks are written for the unwindowed ops).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from bertdist.ops import reference
from bertdist.ops.candidates import WINDOW_OPS, Case
from bertdist.ops.kernel_plan import DTYPES

# Additive error floors per dtype (tests/ops: 1e-6 for bf16/fp16; fp32 kernels match to 1e-5).
FLOORS = {"float64": 1e-9, "float32": 1e-5, "bfloat16": 1e-6, "float16": 1e-6}
SCALE_FLOOR = 1e-2  # a tensor that is ~0 in exact arithmetic is judged by absolute error
SHORT_SEQ_PROB = 0.1  # BERT's create_pretraining_data: a tenth of the rows are short


# ---------------------------------------------------------------- problems


def case_lengths(case: Case) -> torch.Tensor:
    """Row lengths like BERT's pretraining data: most rows full, some a little short, a tenth
    short (uniform in [2, seq]); the first row full so that max_seqlen == seq."""
    g = torch.Generator().manual_seed(case.lengths_seed)
    n, s = case.batch, case.seq
    u = torch.rand(n, generator=g)
    short = torch.randint(min(2, s), s + 1, (n,), generator=g)
    gap = torch.randint(1, max(2, s // 8 + 1), (n,), generator=g)
    nearly = torch.where(torch.rand(n, generator=g) < 0.9, torch.full((n,), s), (s - gap).clamp(min=1))
    lengths = torch.where(u < SHORT_SEQ_PROB, short, nearly)
    lengths[0] = s
    return lengths


@dataclasses.dataclass
class Problem:
    """Inputs of one case, as fp32 masters on the device; ``call`` runs a candidate on them."""

    case: Case
    masters: dict[str, torch.Tensor]  # differentiable inputs (fp32)
    extra: dict  # mask, cu_seqlens, max_seqlen
    out_mask: torch.Tensor | None  # [B, 1, S, 1] bool: outputs compared at real queries only
    grad_out: torch.Tensor  # fp32

    def leaves(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        return {k: v.to(dtype).detach().requires_grad_(True) for k, v in self.masters.items()}

    def call(self, fn: Callable, leaves: dict, *, dropout: bool, bias_in_kernel: bool = True) -> torch.Tensor:
        c, e = self.case, self.extra
        p = c.p if dropout else 0.0
        if c.op == "layer_norm":
            return fn(leaves["x"], leaves["weight"], leaves["bias"], c.eps)
        if c.op == "bias_dropout_add_layer_norm":
            # Kernels that do not take the bias get none: the model adds it in the GEMM (free in cuBLAS).
            bias = leaves["dense_bias"] if bias_in_kernel else None
            return fn(leaves["x"], bias, leaves["residual"], leaves["weight"], leaves["ln_bias"], p=p, training=dropout, eps=c.eps)
        if c.op in ("attention", "window_attention"):
            qkv = leaves["qkv"].permute(2, 0, 3, 1, 4)  # [3, B, H, S, D] views, as the model makes them
            if c.op == "window_attention":
                return fn(qkv[0], qkv[1], qkv[2], e["mask"], half_window=c.half_window, dropout_p=p, training=dropout)
            return fn(qkv[0], qkv[1], qkv[2], e["mask"], dropout_p=p, training=dropout)
        q, k, v = leaves["qkv"].unbind(1)  # [T, H, D] views of [T, 3, H, D]
        if c.op == "varlen_window_attention":
            return fn(q, k, v, e["packing"], half_window=c.half_window, dropout_p=p, training=dropout)
        return fn(q, k, v, e["cu_seqlens"], e["max_seqlen"], dropout_p=p, training=dropout)

    def run(self, fn: Callable, dtype: torch.dtype, *, dropout: bool = False, bias_in_kernel: bool = True,
            masters_dtype: torch.dtype | None = None, backward: bool = True) -> dict[str, torch.Tensor]:
        """Output and input gradients of one call (fp32 copies), keyed "out", "d<input>";
        without ``backward`` the output alone, computed without autograd (inference)."""
        leaves = self.leaves(dtype)
        if masters_dtype is not None:  # the oracle: inputs rounded to the case dtype, computed wider
            leaves = {k: v.detach().to(masters_dtype).requires_grad_(True) for k, v in leaves.items()}
        if not backward:
            with torch.no_grad():
                out = self.call(fn, {k: v.detach() for k, v in leaves.items()}, dropout=dropout,
                                bias_in_kernel=bias_in_kernel)
            return {"out": (out * self.out_mask if self.out_mask is not None else out).float()}
        out = self.call(fn, leaves, dropout=dropout, bias_in_kernel=bias_in_kernel)
        go = self.grad_out.to(out.dtype)
        if self.out_mask is not None:
            go = go * self.out_mask
        names = list(leaves)
        grads = torch.autograd.grad(out, [leaves[n] for n in names], go, allow_unused=True)
        res = {"out": (out * self.out_mask if self.out_mask is not None else out).detach().float()}
        for n, g in zip(names, grads):
            res[f"d{n}"] = torch.zeros_like(leaves[n], dtype=torch.float32) if g is None else g.float()
        return res


def make_problem(case: Case, device: torch.device) -> Problem:
    g = torch.Generator().manual_seed(1234 + case.lengths_seed)
    rows, h = case.batch * case.seq, case.hidden

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    lengths = case_lengths(case)
    if case.op in ("layer_norm", "bias_dropout_add_layer_norm"):
        masters = {"x": randn(rows, h), "weight": 1 + randn(h, scale=0.1), "bias": randn(h, scale=0.1)}
        if case.op == "bias_dropout_add_layer_norm":
            masters = {"x": masters["x"], "dense_bias": randn(h, scale=0.1), "residual": randn(rows, h),
                       "weight": masters["weight"], "ln_bias": masters["bias"]}
        return Problem(case, masters, {}, None, randn(rows, h))
    b, s, heads, d = case.batch, case.seq, case.heads, case.head_dim
    mask = (torch.arange(s)[None, :] < lengths[:, None]).to(device)
    if case.op in ("attention", "window_attention"):
        masters = {"qkv": randn(b, s, 3, heads, d)}
        return Problem(case, masters, {"mask": mask}, mask[:, None, :, None], randn(b, heads, s, d))
    total = int(lengths.sum())
    cu = torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)).to(device=device, dtype=torch.int32)
    masters = {"qkv": randn(total, 3, heads, d)}
    extra = {"cu_seqlens": cu, "max_seqlen": int(lengths.max())}
    if case.op == "varlen_window_attention":
        from bertdist.ops.windowed_attention import Packing

        extra["packing"] = Packing.from_cu_seqlens(cu, extra["max_seqlen"], total)
    return Problem(case, masters, extra, None, randn(total, heads, d))


def oracle_for(op: str) -> Callable:
    """The fp32 math ``op``'s candidates are judged against (run on inputs rounded to the case dtype)."""
    if op == "layer_norm":
        return reference.reference_layer_norm_math
    if op == "bias_dropout_add_layer_norm":
        def bdaln_math(x, bias, residual, weight, ln_bias, *, p, training, eps):
            h = x.float() + (0 if bias is None else bias.float())
            return reference.reference_layer_norm_math(residual.float() + h, weight, ln_bias, eps)
        return bdaln_math
    if op == "attention":
        return reference.reference_attention_math
    if op in WINDOW_OPS:  # the reference twins: the padded math with the window, the per-sequence loop
        from bertdist.ops import windowed_attention

        return getattr(windowed_attention, f"reference_{op}")
    return reference.reference_varlen_attention


def _attention_in_dtype(q, k, v, key_padding_mask, *, half_window=None, dropout_p=0.0, training=False, scale=None):
    """Padded attention as an unfused kernel computes it in q's dtype: Q K^T and P V there (fp32
    accumulation), the softmax in fp32 and P rounded to the dtype."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)).float() * scale
    low = torch.finfo(torch.float32).min  # as the reference: a query without keys gets no NaN
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :].bool(), low)
    if half_window is not None:
        pos = torch.arange(q.shape[-2], device=q.device)
        scores = scores.masked_fill((pos[:, None] - pos[None, :]).abs() > half_window, low)
    probs = torch.nn.functional.dropout(torch.softmax(scores, dim=-1), p=dropout_p, training=training)
    return probs.to(q.dtype) @ v


def _varlen_attention_in_dtype(q, k, v, packing, *, half_window=None, dropout_p=0.0, training=False, scale=None):
    """``_attention_in_dtype`` one packed sequence at a time."""
    out = torch.empty_like(q)
    bounds = packing.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            o = _attention_in_dtype(qs, ks, vs, None, half_window=half_window, dropout_p=dropout_p,
                                    training=training, scale=scale)
            out[start:end] = o.squeeze(0).transpose(0, 1)
    return out


def unfused_twin(op: str, dtype: str) -> Callable | None:
    """The yardstick of a windowed op's bounds in a low-precision dtype (None: its baseline's error is)."""
    if op not in WINDOW_OPS or dtype not in ("bfloat16", "float16"):
        return None
    return _varlen_attention_in_dtype if op == "varlen_window_attention" else _attention_in_dtype


# ---------------------------------------------------------------- errors


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if expected.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    return (a - e).abs().max().item() / max(e.abs().max().item(), SCALE_FLOOR)


# ---------------------------------------------------------------- dropout


# The dropout check: a keep rate outside p +- DROPOUT_SIGMAS binomial standard deviations fails
# (a correct kernel fails about once in 10^9 checks); the forward and backward must use one mask,
# judged against the fp32 math with that mask within DROPOUT_TOL (a different mask changes
# whole elements: errors of order 1).
DROPOUT_SIGMAS = 6.0
DROPOUT_TOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 4e-2, "float16": 5e-3}


def dropout_problem(problem: Problem, fn, dtype, out_plain: torch.Tensor) -> str | None:
    """With the case's dropout the output must change (dropout applied) and stay finite, the
    fraction dropped must be p (a binomial bound), and the backward must regenerate the
    forward's mask."""
    got = problem.run(fn, dtype, dropout=True)
    if not all(bool(torch.isfinite(v).all()) for v in got.values()):
        return "non-finite output or gradient with dropout"
    changed = (got["out"] != out_plain).float().mean().item()
    if changed == 0.0:
        return f"dropout p={problem.case.p:g} changed no output: dropout not applied"
    if problem.case.op == "bias_dropout_add_layer_norm":
        return _bdaln_mask_problem(problem, fn, dtype)
    if problem.case.op in ("attention", "varlen_attention"):
        return _attention_mask_problem(problem.case, fn, dtype, problem.grad_out.device)
    return None


def keep_rate_problem(n: int, dropped: int, p: float) -> str | None:
    """Why ``dropped`` of ``n`` elements is not a binomial(n, p) count, or None."""
    if n == 0:
        return None
    sigma = math.sqrt(n * p * (1 - p))
    if abs(dropped - n * p) > DROPOUT_SIGMAS * sigma + 1:
        return (f"dropout p={p:g} dropped {dropped} of {n} elements ({dropped / n:.2%}); a binomial({n}, {p:g}) "
                f"count lies within {n * p:.0f} +- {DROPOUT_SIGMAS:g} x {sigma:.1f}")
    return None


def _mask_mismatch(got: dict, ref: dict, dtype: str, which: str) -> str | None:
    tol = DROPOUT_TOL[dtype]
    errs = {k: rel_err(got[k], ref[k]) for k in got}
    worst = max(errs, key=errs.get)
    if not errs[worst] <= tol:
        return (f"{which}: error {errs[worst]:.3e} on {worst} > {tol:g} against the fp32 math with that mask "
                "(the forward and backward do not use one dropout mask)")
    return None


def _bdaln_mask_problem(problem: Problem, fn, dtype) -> str | None:
    """The backward's mask is where d(x) is exactly 0; the forward output must be the one that mask gives."""
    case = problem.case
    got = problem.run(fn, dtype, dropout=True)
    keep = got["dx"] != 0
    bad = keep_rate_problem(keep.numel(), int((~keep).sum()), case.p)
    if bad:
        return bad

    def with_mask(x, bias, residual, weight, ln_bias, *, p, training, eps):
        h = (x if bias is None else x + bias) * keep / (1 - p)
        return reference.reference_layer_norm_math(residual + h, weight, ln_bias, eps)

    ref = problem.run(with_mask, DTYPES[case.dtype], dropout=True, masters_dtype=torch.float32)
    return _mask_mismatch(got, ref, case.dtype, "the forward output is not the one the backward's mask gives")


def _attention_probe(case: Case, device: torch.device) -> tuple[Problem, torch.Tensor, torch.Tensor]:
    """A problem whose output shows the dropped attention probabilities: sequences of at most
    head_dim tokens, v[key j] = e_j, so out[query i][j] = keep[i, j] * P[i, j] / (1 - p). Also
    the [B, S] key mask and, for varlen, each packed token's flat padded position."""
    seq = min(case.seq, case.head_dim)
    probe = make_problem(dataclasses.replace(case, seq=seq), device)
    qkv = probe.masters["qkv"]
    if case.op == "attention":  # [B, S, 3, H, D]
        qkv[:, :, :2] *= 0.5  # flatter probabilities: every kept one well above zero in fp16
        v = qkv[:, :, 2]
        v.zero_()
        j = torch.arange(seq, device=device)
        v[:, j, :, j] = 1.0
        return probe, probe.extra["mask"], None
    from bertdist.ops import torch_native

    cu = probe.extra["cu_seqlens"]
    total = qkv.shape[0]
    index = torch_native.packed_index(cu, total, seq)  # [T] -> b * seq + position
    qkv[:, :2] *= 0.5
    v = qkv[:, 2]  # [T, H, D]
    v.zero_()
    v[torch.arange(total, device=device), :, index % seq] = 1.0
    return probe, torch_native.lengths_mask(cu, seq), index


def _attention_mask_problem(case: Case, fn, dtype, device: torch.device) -> str | None:
    """The forward's mask is read from the probe's output; the gradients must be the ones that mask gives."""
    from bertdist.ops import torch_native

    probe, key_mask, index = _attention_probe(case, device)
    got = probe.run(fn, dtype, dropout=True)
    b, seq = key_mask.shape
    out = got["out"]
    if index is not None:  # packed [T, H, D] -> [B, H, S, D]
        out = torch_native.repad(out, index, b, seq)
    probs = out[..., :seq]  # [B, H, S(query), S(key)]
    real = key_mask[:, None, :, None] & key_mask[:, None, None, :]
    keep = probs != 0
    bad = keep_rate_problem(int(real.expand_as(probs).sum()), int((real & ~keep).sum()), case.p)
    if bad:
        return bad
    scale = 1.0 / math.sqrt(case.head_dim)

    def padded_with_mask(q, k, v, kpm, *, dropout_p, training, scale=scale):
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~kpm[:, None, None, :], float("-inf"))
        return (torch.softmax(scores, dim=-1) * keep / (1 - dropout_p)) @ v

    def varlen_with_mask(q, k, v, cu_seqlens, max_seqlen, *, dropout_p, training):
        padded = [torch_native.repad(t, index, b, seq) for t in (q, k, v)]
        return torch_native.unpad(padded_with_mask(*padded, key_mask, dropout_p=dropout_p, training=training), index)

    ref = probe.run(padded_with_mask if index is None else varlen_with_mask, DTYPES[case.dtype], dropout=True,
                    masters_dtype=torch.float32)
    return _mask_mismatch(got, ref, case.dtype, "the gradients are not the ones the forward's mask gives")
