import pytest

from nbscaler.schedule import Block


def test_blocks_are_values_usable_as_keys():
    assert Block(1, 2, "F") == Block(stage=1, micro=2, phase="F")
    assert {Block(1, 2, "F"): "x"}[Block(1, 2, "F")] == "x"
    assert str(Block(1, 2, "B")) == "B(s1,m2)"


@pytest.mark.parametrize(
    "fields, named",
    [((0, 0, "X"), "Block.phase='X'"), ((-1, 0, "F"), "Block.stage=-1"), ((0, True, "F"), "Block.micro=True")],
)
def test_bad_fields_are_named(fields, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        Block(*fields)
