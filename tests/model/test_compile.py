"""The forward and loss of a training batch compile as one graph (no host sync inside).

``fullgraph=True`` turns every graph break into an error, and a read of a data-dependent size
from the device (``.item()``, ``.tolist()``, ``nonzero``, a boolean index) is one: a graph that
compiles whole has no host sync. The batches carry their packing, as the trainer's loader ships
them (``bertdist.train.loader.packing``).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bertdist.model import IGNORE_INDEX, BertConfig, BertForPreTraining
from bertdist.ops.dispatch import TORCH_NATIVE
from bertdist.train.loader import batch_to_device, packing


def _batch(vocab: int, lengths=(29, 1, 17, 32, 2), width: int = 32, seed: int = 0) -> dict[str, torch.Tensor]:
    """A right-padded training batch with MLM labels, NSP labels and the loader's packing."""
    rng = np.random.default_rng(seed)
    lens = np.array(lengths, dtype=np.int64)
    attention = (np.arange(width)[None, :] < lens[:, None]).astype(np.int64)
    ids = rng.integers(5, vocab, size=attention.shape) * attention
    types = ((np.arange(width)[None, :] >= (lens // 2)[:, None]) & (attention == 1)).astype(np.int64)
    labels = np.where((rng.random(attention.shape) < 0.3) & (attention == 1), ids, IGNORE_INDEX)
    labels[1, 0] = ids[1, 0]
    batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(attention),
             "token_type_ids": torch.from_numpy(types), "labels": torch.from_numpy(labels),
             "next_sentence_label": torch.from_numpy(rng.integers(0, 2, size=len(lens)))}
    return {**batch, **packing(attention, lens, labels)}


def _model(unpad: bool, dropout: float = 0.1) -> BertForPreTraining:
    cfg = BertConfig.from_preset("tiny", vocab_size=300, kernels="reference", unpad=unpad,
                                 hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    torch.manual_seed(0)
    # unpadded: torch's own varlen path (what kernels: reference runs on CUDA; on CPU it re-pads to
    # max_seqlen for SDPA). The CPU reference's per-sequence loop is an oracle, not a compile target.
    return BertForPreTraining(cfg, kernels=TORCH_NATIVE if unpad else None).train()


def _loss(model, **batch):
    return model(**batch).loss


@pytest.mark.slow  # dynamo traces the model twice (two batch shapes): 20-30 s each on the shared 2-core machine
@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_training_forward_and_loss_trace_as_one_graph(unpad):
    torch._dynamo.reset()
    model = _model(unpad)
    batch = batch_to_device(_batch(300), torch.device("cpu"))
    compiled = torch.compile(_loss, backend="eager", fullgraph=True)
    loss = compiled(model, **batch)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # a second batch of other lengths and mask counts: still whole graphs
    other = batch_to_device(_batch(300, lengths=(8, 31, 32, 3, 12), seed=1), torch.device("cpu"))
    assert torch.isfinite(compiled(model, **other))


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for the device: a scalar read (``.item()``,
    ``int()``, ``bool()``) and the ops whose output size depends on the data (nonzero, boolean
    indexing, masked_select, ...). On CPU nothing waits, but the same calls on CUDA each cost a
    host sync (what ``torch.cuda.set_sync_debug_mode`` reports there)."""

    DATA_DEPENDENT = {"_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique_consecutive",
                      "_unique2", "unique_dim", "is_nonzero", "equal"}

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in self.DATA_DEPENDENT:
            self.calls.append(name)
        elif name in ("index", "index_put", "index_put_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.calls.append(f"{name}(bool mask)")
        elif name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) < 4:
            self.calls.append("repeat_interleave without output_size")
        return func(*args, **kwargs)


def _host_reads(model, batch) -> list[str]:
    with HostReads() as reads:
        model(**batch).loss.backward()
    return reads.calls


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_a_training_forward_and_backward_reads_nothing_back_from_the_device(unpad):
    model = _model(unpad)
    batch = batch_to_device(_batch(300), torch.device("cpu"))
    assert _host_reads(model, batch) == []
    # The counter can fail: without the loader's packing, the sparse head finds its masked positions
    # on the device and the unpadded path derives the packing from the mask.
    derived = {k: v for k, v in batch.items() if k not in ("token_index", "cu_seqlens", "max_seqlen",
                                                              "masked_positions")}
    reads = _host_reads(model, derived)
    assert "nonzero" in reads and (not unpad or "_local_scalar_dense" in reads), reads


@pytest.mark.parametrize("unpad", [False, True], ids=["padded", "unpadded"])
def test_shipped_packing_gives_the_same_outputs_as_deriving_it(unpad):
    model = _model(unpad, dropout=0.0).eval()
    batch = batch_to_device(_batch(300), torch.device("cpu"))
    derived = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids", "labels",
                                     "next_sentence_label")}
    with torch.no_grad():
        a, b = model(**batch), model(**derived)
    assert torch.equal(a.mlm_labels, b.mlm_labels)
    assert torch.allclose(a.prediction_logits, b.prediction_logits, atol=1e-6)
    assert torch.allclose(a.loss, b.loss, atol=1e-6)


@pytest.mark.slow  # inductor compiles C++ on CPU: 150 s on the shared 2-core machine
def test_inductor_compiled_training_step_matches_eager():
    torch._dynamo.reset()
    eager, compiled_model = _model(False, dropout=0.0), _model(False, dropout=0.0)
    compiled_model.compile(fullgraph=True)
    batch = batch_to_device(_batch(300), torch.device("cpu"))
    la, lb = eager(**batch).loss, compiled_model(**batch).loss
    la.backward()
    lb.backward()
    assert torch.allclose(la, lb, atol=1e-5)
    grads = dict(compiled_model.named_parameters())
    for name, p in eager.named_parameters():
        assert torch.allclose(p.grad, grads[name].grad, atol=1e-4, rtol=1e-3), name
    assert set(compiled_model.state_dict()) == set(eager.state_dict())  # compiled in place: same names


def test_padded_attention_routed_through_varlen_reads_nothing_back():
    """The padded-attention candidate built on varlen_attn (CUDA only) runs here with the SDPA
    stand-in of the same signature: no host read, and the padded path's result at real tokens."""
    from bertdist.ops import torch_native

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(5, 2, 32, 16, generator=g) for _ in range(3))
    mask = _batch(300)["attention_mask"].bool()  # lengths 29, 1, 17, 32 (no padding), 2
    with HostReads() as reads:
        out = torch_native.attention_via_varlen(q, k, v, mask, varlen=torch_native.varlen_attention_sdpa)
    assert reads.calls == []
    real = mask[:, None, :, None]
    assert torch.allclose(out, torch_native.sdpa_attention(q, k, v, mask) * real, atol=1e-5)
