"""Dataset splits, blending, data-parallel slicing and resumable loading (no files needed)."""

from collections import Counter

import numpy as np
import pytest
import torch

from tessel.data.dataset import TokenDataset, split_ranges
from tessel.data.loader import BlendSchedule, Loader
from tessel.errors import DataError


def corpus(n_docs: int, doc_len: int, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Documents whose tokens encode (document, position) so samples are recognisable."""
    tokens = np.arange(n_docs * doc_len, dtype=np.int64) + offset
    offsets = np.arange(0, n_docs * doc_len + 1, doc_len, dtype=np.int64)
    return tokens, offsets


def dataset(name: str, n_docs: int = 20, doc_len: int = 37, seq_len: int = 8, offset: int = 0):
    tokens, offsets = corpus(n_docs, doc_len, offset)
    return TokenDataset(tokens, offsets, seq_len, None, name)


def test_split_ranges_are_contiguous_cover_everything_and_keep_small_splits():
    for n in (1, 2, 3, 10, 1000):
        for fr in [(0.98, 0.02, 0.0), (0.9, 0.05, 0.05), (1.0, 0.0, 0.0)]:
            ranges = split_ranges(n, fr)
            assert ranges[0][0] == 0 and ranges[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
            if n >= 3 and fr[1] > 0:
                assert ranges[1][1] > ranges[1][0]  # a validation document even when tiny
    assert split_ranges(1000, (0.98, 0.02, 0.0)) == [(0, 980), (980, 1000), (1000, 1000)]


def test_samples_and_document_ids():
    tokens, offsets = corpus(4, 10)
    ds = TokenDataset(tokens, offsets, 6, (1, 4), "x")  # documents 1..3 = tokens 10..39
    assert ds.n_samples == (30 - 1) // 6
    assert ds.sample(0).tolist() == list(range(10, 17))
    assert ds.sample(1).tolist() == list(range(16, 23))
    assert ds.doc_ids(1).tolist() == [0, 0, 0, 0, 1, 1]  # tokens 16..21: doc boundary at 20


def test_blend_proportions_within_one_sample_at_every_prefix():
    sets = [dataset("a", 5), dataset("b", 7), dataset("c", 3)]
    weights = [0.5, 0.3, 0.2]
    sched = BlendSchedule(sets, weights, seed=0, shuffle=True)
    counts = np.zeros(3)
    for n in range(1, 5001):
        d, _ = sched.next()
        counts[d] += 1
        assert np.all(np.abs(counts - np.array(weights) * n) <= 1.0), (n, counts)


def test_order_is_deterministic_per_seed_and_each_epoch_is_a_new_permutation(tmp_path):
    def picks(seed, cache=None):
        sched = BlendSchedule([dataset("a"), dataset("b")], [1, 1], seed, True, cache)
        return [sched.next() for _ in range(400)]

    assert picks(1) == picks(1) and picks(1) != picks(2)
    assert picks(1, tmp_path) == picks(1)  # the cached index is the same index
    assert list(tmp_path.glob("order-*.npy"))
    assert picks(1, tmp_path) == picks(1)  # and read back from the cache
    a = [i for d, i in picks(3) if d == 0]
    n = dataset("a").n_samples
    epochs = [a[k * n : (k + 1) * n] for k in range(len(a) // n)]
    assert all(sorted(e) == list(range(n)) for e in epochs)  # every sample once per epoch
    assert epochs[0] != epochs[1]  # a new epoch reshuffles


def _loader(sets, weights=None, mbs=4, rank=0, dp=1, seed=0, mask=False):
    weights = weights or [1.0] * len(sets)
    return Loader(sets, weights, mbs, seed, True, rank, dp, mask)


def test_data_parallel_ranks_are_disjoint_and_cover_the_global_order():
    sets = [dataset("a"), dataset("b", offset=10_000)]
    single = _loader(sets, mbs=8)
    ranks = [_loader(sets, mbs=2, rank=r, dp=4) for r in range(4)]
    for _ in range(30):
        whole = single.next_batch().inputs
        parts = torch.cat([loader.next_batch().inputs for loader in ranks])
        assert torch.equal(whole, parts)
    assert all(r.state_dict() == single.state_dict() for r in ranks)


def test_resume_mid_epoch_continues_exactly():
    sets = [dataset("a"), dataset("b", offset=10_000)]
    ref = _loader(sets, [0.7, 0.3])
    for _ in range(13):
        ref.next_batch()
    state = ref.state_dict()
    resumed = _loader(sets, [0.7, 0.3])
    resumed.load_state_dict(state)
    for _ in range(40):  # crosses epoch boundaries of both datasets
        a, b = ref.next_batch(), resumed.next_batch()
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)


def test_mixture_change_on_resume_repeats_and_skips_nothing():
    sets = [dataset("a"), dataset("b")]
    first = BlendSchedule(sets, [0.8, 0.2], seed=5, shuffle=True)
    taken = [first.next() for _ in range(100)]
    state = first.state_dict()

    second = BlendSchedule(sets, [0.2, 0.8], seed=5, shuffle=True)
    second.load_state_dict(state)
    after = [second.next() for _ in range(300)]
    # each dataset continues its own order exactly where it stopped
    reference = BlendSchedule(sets, [1.0, 0.0], seed=5, shuffle=True)
    order_a = [reference.next()[1] for _ in range(400)]
    reference = BlendSchedule(sets, [0.0, 1.0], seed=5, shuffle=True)
    order_b = [reference.next()[1] for _ in range(400)]
    got_a = [i for d, i in taken + after if d == 0]
    got_b = [i for d, i in taken + after if d == 1]
    assert got_a == order_a[: len(got_a)] and got_b == order_b[: len(got_b)]
    # and the new weights hold from the change on
    counts = Counter()
    for n, (d, _) in enumerate(after, start=1):
        counts[d] += 1
        assert abs(counts[1] - 0.8 * n) <= 1.0


def test_resume_with_other_datasets_is_refused():
    state = _loader([dataset("a"), dataset("b")]).state_dict()
    with pytest.raises(DataError, match="the datasets changed"):
        _loader([dataset("a"), dataset("c")]).load_state_dict(state)
    with pytest.raises(DataError, match="sizes changed"):
        _loader([dataset("a"), dataset("b", n_docs=30)]).load_state_dict(state)


def test_document_ids_come_with_the_batch_when_masking():
    batch = _loader([dataset("a", doc_len=5)], mask=True).next_batch()
    assert batch.doc_ids is not None and batch.doc_ids.shape == batch.inputs.shape
    # a new document starts wherever the input token is a multiple of 5 (doc_len)
    starts = (batch.inputs % 5 == 0)[:, 1:]
    assert torch.equal(batch.doc_ids[:, 1:] != batch.doc_ids[:, :-1], starts)
    assert _loader([dataset("a")]).next_batch().doc_ids is None
