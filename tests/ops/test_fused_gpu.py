"""CUDA kernels against the reference and against the C++ CPU kernels (needs a GPU)."""
from __future__ import annotations

import pytest
import torch

from bertdist.ops import fused
from bertdist.ops.reference import (
    reference_attention,
    reference_attention_math,
    reference_bias_dropout_add_layer_norm,
    reference_layer_norm,
    reference_varlen_attention,
)
from tests.ops._util import assert_close_rel, assert_low_precision_ok, grads, leaf, padding_mask

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _cuda_kernels():
    ok, why = fused.availability("attention", "cuda")
    if not ok:
        pytest.fail(f"a CUDA device is present but the fused CUDA kernels are not usable: {why}")


def _qkv(b, s, h, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(b, s, 3, h, d, generator=g).to(device=DEV, dtype=dtype).permute(2, 0, 3, 1, 4)
    return [t.detach().requires_grad_(True) for t in qkv]


@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("s", [1, 7, 127, 128, 129, 511, 512])
def test_attention_fp32(s, d):
    q, k, v = _qkv(2, s, 3, d, torch.float32, seed=s + d)
    mask = padding_mask([s, max(1, s // 3)], s).to(DEV)
    out = fused.attention(q, k, v, mask)
    ref_in = [leaf(t) for t in (q, k, v)]
    ref = reference_attention_math(*ref_in, mask)
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name} s={s} d={d}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("s", [128, 512])
def test_attention_low_precision(s, dtype):
    q, k, v = _qkv(4, s, 4, 64, dtype, seed=s)
    mask = padding_mask([s, s // 2, 1, s - 3], s).to(DEV)
    g = torch.randn(4, 4, s, 64, device=DEV).to(dtype)
    out = fused.attention(q, k, v, mask)
    d_f = grads(out, (q, k, v), g)
    lp = [leaf(t) for t in (q, k, v)]
    ref_lp = reference_attention(*lp, mask)
    d_lp = grads(ref_lp, lp, g)
    f32 = [leaf(t.float()) for t in (q, k, v)]
    ref32 = reference_attention_math(*f32, mask)
    d32 = grads(ref32, f32, g.float())
    assert_low_precision_ok(out, ref_lp, ref32, "out")
    for name, a, b, c in zip("qkv", d_f, d_lp, d32):
        assert_low_precision_ok(a, b, c, f"d{name}")


def test_attention_dropout_matches_cpu_kernels():
    # Same Philox counters on both sides: the CUDA output equals the CPU kernel's.
    q, k, v = _qkv(2, 129, 2, 64, torch.float32, seed=1)
    mask = padding_mask([129, 50], 129).to(DEV)
    kw = dict(dropout_p=0.1, training=True, seed=42, offset=3)
    out = fused.attention(q, k, v, mask, **kw)
    cpu = [leaf(t.detach().cpu()) for t in (q, k, v)]
    out_cpu = fused.attention(*cpu, mask.cpu(), **kw)
    assert_close_rel(out.cpu(), out_cpu, 1e-5, "out")
    g = torch.randn_like(out_cpu)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g.to(DEV)), grads(out_cpu, cpu, g)):
        assert_close_rel(a.cpu(), b, 1e-5, f"d{name}")


def test_varlen_attention():
    lengths = [5, 1, 0, 130, 64]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    t = int(cu[-1])
    q, k, v = (torch.randn(t, 2, 64, device=DEV, requires_grad=True) for _ in range(3))
    out = fused.varlen_attention(q, k, v, cu, max(lengths))
    ref_in = [leaf(x) for x in (q, k, v)]
    ref = reference_varlen_attention(*ref_in, cu, max(lengths))
    assert_close_rel(out, ref, 1e-5, "out")
    g = torch.randn_like(ref)
    for name, a, b in zip("qkv", grads(out, (q, k, v), g), grads(ref, ref_in, g)):
        assert_close_rel(a, b, 1e-5, f"d{name}")


@pytest.mark.parametrize("hidden", [128, 768, 1000, 1024, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bias_dropout_add_layer_norm(hidden, dtype):
    g = torch.Generator().manual_seed(hidden)
    mk = lambda *s, sc=1.0: (sc * torch.randn(*s, generator=g)).to(DEV, dtype).requires_grad_(True)  # noqa: E731
    inputs = [mk(300, hidden), mk(hidden, sc=0.1), mk(300, hidden), (1 + mk(hidden, sc=0.1)).detach().requires_grad_(True),
              mk(hidden, sc=0.1)]
    kw = dict(p=0.1, training=False, eps=1e-5)
    gy = torch.randn(300, hidden, generator=g).to(DEV, dtype)
    out = fused.bias_dropout_add_layer_norm(*inputs, **kw)
    d_f = grads(out, inputs, gy)
    f32 = [leaf(t.float()) for t in inputs]
    ref32 = reference_bias_dropout_add_layer_norm(*f32, **kw)
    d32 = grads(ref32, f32, gy.float())
    if dtype == torch.float32:
        assert_close_rel(out, ref32, 1e-5, "y")
        for a, c in zip(d_f, d32):
            assert_close_rel(a, c, 1e-5, "grad")
    else:
        lp = [leaf(t) for t in inputs]
        ref_lp = reference_bias_dropout_add_layer_norm(*lp, **kw)
        d_lp = grads(ref_lp, lp, gy)
        assert_low_precision_ok(out, ref_lp, ref32, "y")
        for a, b, c in zip(d_f, d_lp, d32):
            assert_low_precision_ok(a, b, c, "grad")
    x, w, b = inputs[0], inputs[3], inputs[4]
    assert_close_rel(fused.layer_norm(x.float(), w.float(), b.float(), 1e-5),
                     reference_layer_norm(x.float(), w.float(), b.float(), 1e-5), 1e-5, "layer_norm")


def test_bias_dropout_add_layer_norm_dropout_matches_cpu():
    g = torch.Generator().manual_seed(0)
    cpu = [torch.randn(64, 768, generator=g), torch.randn(768, generator=g), torch.randn(64, 768, generator=g),
           torch.randn(768, generator=g), torch.randn(768, generator=g)]
    cpu = [leaf(t) for t in cpu]
    gpu = [leaf(t.to(DEV)) for t in cpu]
    kw = dict(p=0.1, training=True, eps=1e-12, seed=7, offset=2)
    y_cpu = fused.bias_dropout_add_layer_norm(*cpu, **kw)
    y_gpu = fused.bias_dropout_add_layer_norm(*gpu, **kw)
    assert_close_rel(y_gpu.cpu(), y_cpu, 1e-5, "y")
    gy = torch.randn_like(y_cpu)
    for a, b in zip(grads(y_gpu, gpu, gy.to(DEV)), grads(y_cpu, cpu, gy)):
        assert_close_rel(a.cpu(), b, 1e-5, "grad")


def test_model_fused_matches_reference_on_gpu():
    from bertdist.model.bert import BertForPreTraining
    from bertdist.model.config import BertConfig

    torch.manual_seed(0)
    kw = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_hidden_layers=2)
    ref = BertForPreTraining(BertConfig.from_preset("base", kernels="reference", **kw), device_type="cuda").to(DEV)
    fus = BertForPreTraining(BertConfig.from_preset("base", kernels="fused", **kw), device_type="cuda").to(DEV)
    fus.load_state_dict(ref.state_dict())
    ids = torch.randint(5, 30000, (4, 128), device=DEV)
    attn = padding_mask([128, 100, 64, 3], 128).long().to(DEV)
    out_r, out_f = ref(ids, attn), fus(ids, attn)
    assert_close_rel(out_f.prediction_logits, out_r.prediction_logits, 1e-4, "logits")


def _capture(fn):
    """fn() run twice on a side stream (autograd and allocator warm-up), then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_dropout_in_cuda_graph_draws_fresh_masks_and_backward_matches_forward():
    # seed=None: the kernels take the CUDA generator's Philox state, unpacked on the device, so
    # each replay of one captured graph drops other elements; the backward reads the (seed,
    # offset) its forward recorded, so within a replay both passes use the same mask.
    p, rows, hidden, s = 0.5, 64, 256, 64
    x = torch.ones(rows, hidden, device=DEV, requires_grad=True)
    res = torch.zeros(rows, hidden, device=DEV, requires_grad=True)
    w, b = torch.ones(hidden, device=DEV), torch.zeros(hidden, device=DEV)
    gy = torch.randn(rows, hidden, device=DEV)
    # Attention with q = k = 0 (uniform probabilities) and V = I: out row i is row i of the keep
    # mask, scaled; with grad_out = I, dV is the transposed scaled mask.
    q = torch.zeros(2, 2, s, 64, device=DEV, requires_grad=True)
    v = torch.eye(s, device=DEV).expand(2, 2, s, s).contiguous().requires_grad_(True)
    go = torch.eye(s, device=DEV).expand(2, 2, s, s).contiguous()

    def step():
        x.grad = res.grad = v.grad = None
        y = fused.bias_dropout_add_layer_norm(x, None, res, w, b, p=p, training=True, eps=1e-5)
        y.backward(gy)
        out = fused.attention(q, q, v, None, dropout_p=p, training=True)
        out.backward(go)
        return y, out

    graph, (y, out) = _capture(step)
    masks = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        # LN: h = keep / (1 - p) with x = 1, residual = 0, so y > 0 exactly where kept; the
        # backward's x gradient is nonzero exactly where its own mask keeps.
        ln_fwd, ln_bwd = y > 0, x.grad != 0
        assert torch.equal(ln_fwd, ln_bwd), "LN backward regenerated another mask than its forward"
        at_fwd, at_bwd = out != 0, v.grad.transpose(-1, -2) != 0
        assert torch.equal(at_fwd, at_bwd), "attention backward regenerated another mask than its forward"
        for m in (ln_fwd, at_fwd):
            rate = m.float().mean().item()
            assert abs(rate - (1 - p)) < 0.05, f"keep rate {rate:.3f}"
        masks.append((ln_fwd.clone(), at_fwd.clone()))
    assert not torch.equal(masks[0][0], masks[1][0]), "two replays gave the same LN dropout mask"
    assert not torch.equal(masks[0][1], masks[1][1]), "two replays gave the same attention dropout mask"


def test_generator_dropout_is_seeded_and_recorded():
    # Without a seed the CUDA generator decides: torch.manual_seed reproduces it, and the op's
    # record reproduces the mask through the CPU keep-mask helper (same Philox function).
    from bertdist.ops._extension import load

    C, _ = load()
    p, s = 0.2, 64
    q = torch.zeros(2, 2, s, 64, device=DEV)
    v = torch.eye(s, device=DEV).expand(2, 2, s, s).contiguous()
    kw = dict(dropout_p=p, training=True)
    torch.manual_seed(5)
    a = fused.attention(q, q, v, None, **kw)
    torch.manual_seed(5)
    b = fused.attention(q, q, v, None, **kw)
    assert torch.equal(a, b) and not torch.equal(a, fused.attention(q, q, v, None, **kw))
    out, _, rng = torch.ops.bertdist.attention_fwd(q, q, v, None, 0.125, p, None, 0)
    seed, offset = rng.tolist()
    assert torch.equal((out != 0).cpu().reshape(4, s, s), C.attention_keep_mask(4, s, s, p, seed, offset))
    x = torch.ones(8, 128, device=DEV)
    zero, w, bias = torch.zeros(8, 128, device=DEV), torch.ones(128, device=DEV), torch.zeros(128, device=DEV)
    _, h, _, _, rng = torch.ops.bertdist.bias_dropout_add_layer_norm_fwd(x, None, zero, w, bias, p, 1e-5, None, 0)
    seed, offset = rng.tolist()
    assert torch.equal((h != 0).cpu(), C.hidden_keep_mask(8, 128, p, seed, offset))
