"""Students from a spec: layers of the teacher (DistilBERT init), a random preset, or a checkpoint
whose vocabulary must be the teacher's."""
import pytest
import torch

from bertdist.distill.student import StudentSpecError, plan_student
from bertdist.distill.teacher import TeacherError, load_teacher
from tests.distill import fixtures as fx


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("student")
    vocab = fx.write_vocab(tmp / "vocab.txt")
    data = fx.write_sst2(tmp / "sst2")
    # 4 layers, so that layers:2 has a choice to make
    t_dir = fx.teacher(tmp, "sst2", data, vocab, steps=2, num_hidden_layers=4)
    teacher = load_teacher(t_dir, "sst2", "classification", 2, device=torch.device("cpu"), kernels="reference")
    return tmp, vocab, teacher


def test_layers_k_copies_evenly_spread_teacher_layers_embeddings_and_head(setup):
    _, _, teacher = setup
    plan = plan_student("layers:2", teacher, "classification")
    assert plan.teacher_layers == [0, 3]
    student = plan.build("classification", 2, "cpu", kernels="reference")
    t = teacher.model.state_dict()
    s = student.state_dict()
    assert student.bert.config.num_hidden_layers == 2
    for s_i, t_i in enumerate([0, 3]):
        for name in ("attention.self.query.weight", "output.dense.weight"):
            assert torch.equal(s[f"bert.encoder.layer.{s_i}.{name}"], t[f"bert.encoder.layer.{t_i}.{name}"])
    for name in ("bert.embeddings.word_embeddings.weight", "bert.pooler.dense.weight", "classifier.weight"):
        assert torch.equal(s[name], t[name])


def test_preset_student_is_random_with_the_teacher_vocab_and_head_only_where_shapes_match(setup):
    _, _, teacher = setup
    plan = plan_student("preset:tiny", teacher, "classification")
    assert plan.backbone_state is None and plan.config.vocab_size == teacher.config.vocab_size
    assert plan.head_state  # tiny has the teacher's width (128): the head is copied
    with pytest.raises(StudentSpecError, match="unknown preset 'huge'"):
        plan_student("preset:huge", teacher, "classification")
    with pytest.raises(StudentSpecError, match="K must be in 1..4"):
        plan_student("layers:5", teacher, "classification")


def test_checkpoint_with_another_vocabulary_is_refused_listing_both(setup):
    tmp, vocab, teacher = setup
    other_vocab = fx.write_vocab(tmp / "other_vocab.txt", extra=["zebra"])
    other = fx.tiny_base(tmp / "other_ckpt", other_vocab)
    with pytest.raises(StudentSpecError) as e:
        plan_student(str(other), teacher, "classification")
    msg = str(e.value)
    assert f"teacher {teacher.vocab_file}" in msg and f"{other}/vocab.txt" in msg
    n = len(vocab.read_text().splitlines())
    assert f"({n} tokens" in msg and f"({n + 1} tokens" in msg
    same = fx.tiny_base(tmp / "same_ckpt", vocab)
    plan = plan_student(str(same), teacher, "classification")
    assert plan.backbone_state is not None


def test_a_pretraining_checkpoint_is_not_a_teacher(setup):
    tmp, vocab, _ = setup
    base = fx.tiny_base(tmp / "pretraining_only", vocab)
    with pytest.raises(TeacherError, match=r"config.json:\d+: architectures \['BertForPreTraining'\] is not a sst2 task"):
        load_teacher(base, "sst2", "classification", 2, device=torch.device("cpu"))
