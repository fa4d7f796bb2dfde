import numpy as np
import pytest
import torch

from examples.gpt.corpus import Batches, load_corpus


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_stdlib_corpus_has_disjoint_train_and_validation(corpus):
    train, valid = corpus
    assert len(train) > 10_000_000 and len(valid) > 100_000
    assert b"def " in valid[:200_000].tobytes()


def test_batch_is_a_function_of_the_iteration(corpus):
    train, valid = corpus
    a = Batches(train, valid, seq_length=32, micro_batch=4, grad_accum=3, seed=7)
    b = Batches(train, valid, seq_length=32, micro_batch=4, grad_accum=3, seed=7)
    list(a.micro_batches(0))  # history must not matter
    for (x1, y1), (x2, y2) in zip(a.micro_batches(5), b.micro_batches(5)):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
        assert torch.equal(x1[:, 1:], y1[:, :-1])  # labels are the next bytes
    assert not torch.equal(next(a.micro_batches(5))[0], next(a.micro_batches(6))[0])


def test_data_parallel_ranks_get_different_data(corpus):
    train, valid = corpus
    r0 = Batches(train, valid, seq_length=32, micro_batch=4, grad_accum=2, dp_rank=0, dp_size=2)
    r1 = Batches(train, valid, seq_length=32, micro_batch=4, grad_accum=2, dp_rank=1, dp_size=2)
    assert not torch.equal(next(r0.micro_batches(3))[0], next(r1.micro_batches(3))[0])
    v0, v1 = r0.validation(), r1.validation()
    assert len(v0) == len(v1) == 64 // 2 // 4
    assert all(x.shape == (4, 32) for x, _ in v0)
    assert not torch.equal(v0[0][0], v1[0][0])


def test_any_directory_of_text_files(tmp_path):
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_bytes(bytes([65 + i % 26]) * 500)
    train, valid = load_corpus(str(tmp_path))
    assert len(train) + len(valid) == 40 * 500 + 38  # files joined by newlines
    assert set(np.unique(np.concatenate([train, valid]))) <= set(range(65, 91)) | {10}


def test_bad_corpus_directories(tmp_path):
    with pytest.raises(FileNotFoundError, match="corpus directory not found"):
        load_corpus(str(tmp_path / "missing"))
    (tmp_path / "one.txt").write_text("x")
    with pytest.raises(ValueError, match="train/validation split"):
        load_corpus(str(tmp_path))
