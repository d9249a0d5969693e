"""Shared fixtures and the skip rules for marked tests (see pyproject's markers)."""
from __future__ import annotations

import os
import socket
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLES = REPO / "data_pipeline" / "samples"  # bundled real text: tests need no ../shared
# Beam DirectRunner in this process: no worker start-up cost, fine for the bundled samples.
IN_PROCESS = ["--runner=DirectRunner", "--direct_running_mode=in_memory", "--direct_num_workers=1"]
# CI clones the repo with ../shared beside it; a user's fresh clone has none.
SHARED_DATA = Path(os.environ.get("BERTDIST_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def pytest_configure(config):
    # `make test` runs two pytest workers on the 2 cores: each worker's torch gets one thread, or
    # the two OpenMP pools would spin against each other on every op. Processes a test starts
    # choose their own threads.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    has_shared = SHARED_DATA.is_dir()
    has_cuda = _cuda_available()
    for item in items:
        if "shared" in item.keywords and not has_shared:
            item.add_marker(pytest.mark.skip(reason=f"../shared/data not found at {SHARED_DATA}"))
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def free_port() -> int:
    """A free TCP port on loopback, for launchers that need a port before they start (the DeepSpeed
    launcher's --master_port). torchrun needs none: tests start it with --standalone, so its agent
    binds a port itself and no other process can take it in between."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Rendezvous variables: a child that inherits them from this process (a test's in-process group sets
# them) would try to bind or join this process's port.
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE",
                  "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE")


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a process a test launches: this one's, less any rendezvous variables."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env.update(extra)
    return env


def torchrun(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` for ``nproc`` local processes, rendezvous on a port its
    agent picks and keeps (--standalone)."""
    import sys

    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]


# Helpers that Python's multiprocessing starts once and keeps for the interpreter's lifetime.
_INTERPRETER_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")


def _is_leftover(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE and not any(h in " ".join(p.cmdline()) for h in _INTERPRETER_HELPERS)
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """A test must leave no process behind: one would slow, or take a port from, the tests after it.
    Anything this test started that still runs afterwards is killed, and the test fails naming it."""
    yield
    left = [p for p in psutil.Process().children(recursive=True) if _is_leftover(p)]
    if not left:
        return
    names = []
    for p in left:
        try:
            names.append(f"pid {p.pid}: {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=10)
    if names:
        pytest.fail("the test left processes running (killed now):\n  " + "\n  ".join(names))


@pytest.fixture(autouse=True)
def torch_linear_restored():
    """DeepSpeed's ZeRO-3 engine replaces ``torch.nn.functional.linear`` for the whole process (its
    ``zero3_linear_wrap``) and never puts it back. A `bertdist pretrain` process builds one engine;
    a test process builds many, so the original is restored after each test, or a ZeRO-3 test
    would change what every later test's linear layers run."""
    import sys

    functional = sys.modules.get("torch.nn.functional")
    original = functional.linear if functional is not None else None
    yield
    functional = sys.modules.get("torch.nn.functional")
    if functional is None:
        return
    if original is None:  # torch came in during this test: its linear is the C++ one, if not wrapped
        wrapped = getattr(functional.linear, "__module__", "").startswith("deepspeed")
        original = getattr(sys.modules["torch"]._C._nn, "linear") if wrapped else functional.linear
    functional.linear = original


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; tests using it must also carry @pytest.mark.shared."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"../shared/data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory) -> Path:
    """A 3,000-token WordPiece vocab trained on the bundled books."""
    from data_pipeline.config import InputConfig
    from data_pipeline.tokenization import train_vocab
    from data_pipeline.vocab_corpus import iter_sentences

    out = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    train_vocab(iter_sentences([InputConfig(kind="books", path=str(SAMPLES / "books"))]), out,
                vocab_size=3000, lowercase=True)
    return out


def train_bpe_tokenizer(out: Path, text_file: Path, vocab_size: int = 2000, *, specials_first: bool = False) -> Path:
    """A small byte-level BPE ``tokenizer.json`` trained on ``text_file``, laid out as ModernBERT's:
    the BPE vocabulary, then [UNK] [CLS] [SEP] [PAD] [MASK] as added special tokens, and a
    TemplateProcessing post-processor "[CLS] $A [SEP]"; no tokenizer_config.json. ``specials_first``
    puts the special tokens at ids 0-4 instead."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=specials if specials_first else [],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text_file.read_text(encoding="utf-8").splitlines(), trainer=trainer)
    tok.add_special_tokens(specials)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[(t, tok.token_to_id(t)) for t in ("[CLS]", "[SEP]")])
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    return out


@pytest.fixture(scope="session")
def small_bpe_tokenizer(tmp_path_factory) -> Path:
    """A 2,000-token byte-level BPE tokenizer.json trained on Macbeth (ModernBERT's layout)."""
    return train_bpe_tokenizer(tmp_path_factory.mktemp("bpe") / "tokenizer.json",
                               SAMPLES / "books" / "shakespeare-macbeth.txt")


@pytest.fixture(scope="session")
def packed_records(tmp_path_factory, small_bpe_tokenizer) -> Path:
    """ModernBERT-style records: the bundled wiki sample, Macbeth and Persuasion cut into short
    documents (80-600 words: many share a row) through the BPE tokenizer.json, packed into
    1,024-token rows, unmasked (30% dynamic masking)."""
    import json
    import random

    from data_pipeline import build_records

    folder = tmp_path_factory.mktemp("packed")
    words = (SAMPLES / "books" / "austen-persuasion.txt").read_text(encoding="utf-8").split()
    rng, docs, i = random.Random(0), [], 0
    while i < len(words):
        n = rng.randint(80, 600)
        docs.append({"id": f"persuasion-{len(docs)}", "text": " ".join(words[i:i + n])})
        i += n
    (folder / "short.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books' / 'shakespeare-macbeth.txt'}",
                          f"jsonl:{folder / 'short.jsonl'}"],
                         folder / "records", small_bpe_tokenizer, max_seq_length=1024, objective="none", masking="dynamic",
                         masked_lm_prob=0.3, dupe_factor=1, pack_documents=True, num_shards=2,
                         pack_group_tokens=20_000, dedup={"enabled": False})


@pytest.fixture(scope="session")
def sample_records(tmp_path_factory, small_vocab) -> Path:
    """Records from the bundled wiki sample + books, built in-process (a few seconds)."""
    from data_pipeline import build_records

    out = tmp_path_factory.mktemp("records")
    return build_records([f"wiki:{SAMPLES / 'wiki'}", f"books:{SAMPLES / 'books'}"], out, small_vocab,
                         max_seq_length=64, dupe_factor=1, num_shards=3, heldout_fraction=0.1,
                         max_predictions_per_seq=10)
