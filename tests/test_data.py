"""zj.data: the corpus is the standard library's bytes; windows are slices of it."""

import pathlib
import sysconfig

import numpy as np
import pytest

import zerojax as zj


def test_the_corpus_is_the_stdlib_files_in_name_order():
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    want = np.frombuffer(b"".join(p.read_bytes() for p in files[:3]), np.uint8)
    got = zj.data.stdlib_bytes(len(want))
    np.testing.assert_array_equal(got, want)
    assert zj.data.stdlib_bytes(len(want) - 5).shape == (len(want) - 5,)


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_window_is_a_slice_of_the_corpus(seed):
    rng = np.random.default_rng(seed)
    corpus = rng.integers(0, 256, size=int(rng.integers(50, 400)), dtype=np.uint8)
    bs, seq = int(rng.integers(1, 6)), int(rng.integers(1, 40))
    stream = zj.data.windows(corpus, bs, seq, seed=seed)
    first = [next(stream)["tokens"] for _ in range(3)]
    again = zj.data.windows(corpus, bs, seq, seed=seed)
    for b in first:
        assert b.shape == (bs, seq + 1) and b.dtype == np.int32
        np.testing.assert_array_equal(b, next(again)["tokens"])  # one seed, one sequence
        # a random corpus of bytes: each window occurs in it as a contiguous run
        hay = corpus.astype(np.int32)
        for row in b:
            starts = np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(hay, seq + 1) == row, axis=1))
            assert starts.size >= 1 and starts.max() <= len(corpus) - seq - 1


@pytest.mark.parametrize(
    "args, match",
    [
        ((np.zeros(10, np.uint8), 2, 9), "shorter than a window of 10"),
        ((np.zeros(10, np.uint8), 0, 4), "batch_size must be an int >= 1, got 0"),
        ((np.zeros(10, np.uint8), 2, 2.0), "seq_len must be an int >= 1, got 2.0"),
    ],
)
def test_bad_windows_are_refused_naming_the_value(args, match):
    with pytest.raises(ValueError, match=match):
        next(zj.data.windows(*args))
    with pytest.raises(ValueError, match="max_bytes must be an int >= 1, got 0"):
        zj.data.stdlib_bytes(0)
