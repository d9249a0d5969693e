"""The torch-native CUDA paths and kernels: auto's measured choice on a real GPU (needs one).

Run by `bertdist bench` (the GPU acceptance); skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from bertdist.model import BertConfig, BertForPreTraining
from bertdist.ops import kernel_plan, kernels_for_run, selection, torch_native
from bertdist.ops.decision_cache import DecisionCache
from bertdist.ops.reference import reference_attention, reference_attention_math, reference_varlen_attention
from tests.ops._util import assert_low_precision_ok, grads, leaf, padding_mask

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _packed(lengths, h, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, h, d, generator=g).to(DEV, dtype)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv.unbind(1))
    cu = torch.nn.functional.pad(torch.cumsum(torch.tensor(lengths), 0), (1, 0)).to(DEV, torch.int32)
    return q, k, v, cu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_attn_within_twice_torchs_own_error(dtype, d):
    lengths = [128, 77, 1, 128, 5]
    q, k, v, cu = _packed(lengths, 4, d, dtype)
    out = torch_native.varlen_attention_flash(q, k, v, cu, 128)
    g = torch.randn_like(out)
    d_out = grads(out, (q, k, v), g)
    lp = [leaf(t) for t in (q, k, v)]
    ref_lp = torch_native.varlen_attention_sdpa(*lp, cu, 128)  # torch's padded kernel, same precision
    d_lp = grads(ref_lp, lp, g)
    f32 = [leaf(t.float()) for t in (q, k, v)]
    ref32 = reference_varlen_attention(*f32, cu, 128)
    d32 = grads(ref32, f32, g.float())
    assert_low_precision_ok(out, ref_lp, ref32, "out")
    for name, a, b, c in zip("qkv", d_out, d_lp, d32):
        assert_low_precision_ok(a, b, c, f"d{name}")


def test_padded_attention_through_varlen_attn_matches_sdpa():
    s = 128
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(4, s, 3, 4, 64, generator=g).to(DEV, torch.bfloat16).permute(2, 0, 3, 1, 4)
    q, k, v = (t.detach().requires_grad_(True) for t in qkv)
    mask = padding_mask([s, 90, 3, s - 1], s).to(DEV)
    real = mask[:, None, :, None]
    out = torch_native.attention_via_varlen(q, k, v, mask) * real
    lp = [leaf(t) for t in (q, k, v)]
    ref_lp = reference_attention(*lp, mask) * real
    f32 = [leaf(t.float()) for t in (q, k, v)]
    ref32 = reference_attention_math(*f32, mask) * real
    assert_low_precision_ok(out, ref_lp, ref32, "out")


def test_measured_choice_on_this_gpu_passed_numerics_and_is_cached(tmp_path):
    """Whether auto is slower than reference is judged on whole training steps by the acceptance
    (benchmarks/acceptance.py): the times that made the choice cannot show it."""
    cfg = BertConfig.from_preset("base", vocab_size=30522)
    w = kernel_plan.Workload.for_model(cfg, batch=16, seq=128, precision="bf16")
    plan = selection.decide(w, torch.device(DEV), cache=DecisionCache(tmp_path / "kd.json"))
    print(plan.table())
    for d in plan.decisions.values():
        chosen = d.measurement(d.choice)
        assert chosen.status == "passed" and chosen.error <= chosen.bound, d.case.key
    again = selection.decide(w, torch.device(DEV), cache=DecisionCache(tmp_path / "kd.json"))
    assert again.note.startswith("cached")


def test_model_on_the_auto_plan_matches_torch_native(tmp_path):
    cfg = BertConfig.from_preset("base", vocab_size=30522, unpad=True, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    dev = torch.device(DEV)
    ks = kernels_for_run("auto", cfg, dev, micro_batch=8, seq=128, precision="bf16", run_dir=str(tmp_path),
                         cache=DecisionCache(tmp_path / "kd.json"))
    assert (tmp_path / "kernel_decisions.json").is_file()
    torch.manual_seed(0)
    ours = BertForPreTraining(cfg, device_type="cuda", kernels=ks).to(dev, torch.bfloat16)
    ref = BertForPreTraining(cfg, device_type="cuda", kernels=torch_native_set()).to(dev, torch.bfloat16)
    ref.load_state_dict(ours.state_dict())
    ids = torch.randint(5, 30522, (8, 128), device=dev)
    mask = padding_mask([128, 100, 64, 128, 7, 128, 90, 128], 128).to(dev).long()
    a, b = ours(ids, mask).seq_relationship_logits.float(), ref(ids, mask).seq_relationship_logits.float()
    assert (a - b).abs().max().item() < 0.05 * max(1.0, b.abs().max().item())


def torch_native_set():
    from bertdist.ops import TORCH_NATIVE

    return TORCH_NATIVE
