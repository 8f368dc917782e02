import pytest

from nbscaler.ir.annotation import AnnotationError, OpAnnotation


def test_parse_expands_star_and_marks():
    a = OpAnnotation.parse("* k+, n k+ -> * n", [(8, 3, 16), (32, 16)], [(8, 3, 32)])
    assert a.inputs == [("*0", "*1", "k"), ("n", "k")]
    assert a.outputs == [("*0", "*1", "n")]
    assert a.reduce == {"k"} and a.sizes["n"] == 32


def test_split_rules():
    a = OpAnnotation.parse("* k+, n k+ -> * n", [(8, 16), (32, 16)], [(8, 32)])
    assert a.split_dims("n") == ([None, 0], [1])
    assert a.split_dims("k") == ([1, 1], [None])
    assert a.can_split("n", 4) is None
    assert "not divisible" in a.can_split("n", 3)
    assert "no dimension named" in a.can_split("zz", 2)
    soft = OpAnnotation.parse("b d^ -> b d^", [(4, 8)], [(4, 8)])
    assert "must not be split" in soft.can_split("d", 2)
    assert soft.splittable(2) == ["b"]


def test_vanishing_axis_must_be_a_sum():
    a = OpAnnotation.parse("b d -> b", [(4, 8)], [(4,)])
    assert "vanishes" in a.can_split("d", 2)


def test_scalar_output_and_mismatched_annotation():
    a = OpAnnotation.parse("n+ -> ", [(4,)], [()])
    assert a.outputs == [()] and a.can_split("n", 2) is None
    with pytest.raises(AnnotationError):
        OpAnnotation.parse("a b -> a", [(1, 2, 3)], [(1,)])
    with pytest.raises(AnnotationError):
        OpAnnotation.parse("a b", [(1, 2)], [(1,)])


def test_str_round_trips_marks():
    a = OpAnnotation.parse("* k+, n k+ -> * n", [(8, 16), (32, 16)], [(8, 32)])
    assert str(a) == "*0 k+, n k+ -> *0 n"
