"""serving.first_exact: the self-check loop the exact and quantized products and
the exact attention share."""

import mlx.core as mx

from dflash_mlx.kernels.serving import first_exact


def result(ok, detail, tried=None):
    return ok, detail, tried


def test_the_first_try_that_matches_wins_and_the_kernel_is_built_once():
    built, seen = [], []
    builders = {"gpu": lambda where: built.append(where) or "kernel"}
    want = mx.array([1.0, 2.0])

    def pairs(kernel, tried):
        seen.append((kernel, tried))
        yield (want if tried == "b" else want + 1), want, ""

    made = {}
    got = first_exact("gpu", ("a", "b", "c"), (made, builders), pairs, result, passed="equal")
    assert got == (True, "equal", "b") and built == ["gpu"] and made == {"gpu": "kernel"}
    assert seen == [("kernel", "a"), ("kernel", "b")]


def test_a_mismatch_names_where_and_the_last_try_is_kept():
    def pairs(kernel, tried):
        yield mx.array([1.0]), mx.array([1.0]), "at 1 keys: "
        yield mx.array([1.0, 3.0]), mx.array([1.0, 2.0]), "at 2 keys: "

    ok, detail, tried = first_exact("gpu", (0, 2), ({"gpu": None}, {}), pairs, result, passed="equal")
    assert not ok and tried == 2 and detail.startswith("at 2 keys: 1 of 2 outputs differ")


def test_a_build_error_fails_without_naming_a_try():
    def broken(where):
        raise RuntimeError("error: use of undeclared identifier 'qv_load'")

    ok, detail, tried = first_exact("gpu", (0, 1), ({}, {"gpu": broken}), None, result, passed="equal")
    assert not ok and tried is None and detail == "RuntimeError: error: use of undeclared identifier 'qv_load'"
