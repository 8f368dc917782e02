"""A damaged checkpoint is refused with an error that names it, never loaded as other numbers.

``torch.load`` does not check the CRC-32 that ``torch.save`` stores for each record, so a flipped
bit in a tensor's bytes used to load as a silently different weight; ``checkpoint.load`` checks them.
"""

import pytest
import torch

from nbscaler.runtime import checkpoint
from nbscaler.runtime.statecheck import CheckpointError

pytestmark = pytest.mark.slow     # seconds: a load for every byte and every length of a file

STATE = {"w": torch.arange(300, dtype=torch.float32), "b": torch.ones(4), "step": 3}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pt"
    checkpoint.save(STATE, path)
    return path.read_bytes()


def refused(path, data: bytes) -> bool:
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match="damaged or incomplete") as info:
        checkpoint.load(path)
    return str(path) in str(info.value)


def same_state(loaded) -> bool:
    return (set(loaded) == set(STATE) and loaded["step"] == STATE["step"]
            and all(torch.equal(loaded[k], STATE[k]) for k in ("w", "b")))


@pytest.mark.parametrize("bit", range(8))
def test_a_flipped_bit_is_refused_or_changes_nothing(saved, tmp_path, bit):
    """Many bytes of the archive (the padding that aligns tensors, a version field) mean nothing to
    the reader; every byte of the tensors and of the pickle does. Some flips in the directory (a
    record marked as a folder, or as compressed) once made torch's reader load uninitialised memory,
    which passed or failed by chance: every bit of every byte is tried."""
    path = tmp_path / "flipped.pt"
    refusals = set()
    for at in range(len(saved)):
        data = bytearray(saved)
        data[at] ^= 1 << bit
        path.write_bytes(bytes(data))
        try:
            assert same_state(checkpoint.load(path)), f"bit {bit} of byte {at} flipped loads as other values"
        except CheckpointError as err:
            assert str(path) in str(err)
            refusals.add(at)
    with open(tmp_path / "flipped.pt", "wb") as f:
        f.write(saved)
    with open(tmp_path / "flipped.pt", "rb") as f:
        reader = torch._C.PyTorchFileReader(f)
        meaningful = {at for name in ("data.pkl", "data/0", "data/1")
                      for at in range(reader.get_record_offset(name),
                                      reader.get_record_offset(name) + len(reader.get_record(name)))}
    assert meaningful <= refusals


def test_every_truncation_is_refused(saved, tmp_path):
    for length in range(len(saved)):
        assert refused(tmp_path / "truncated.pt", saved[:length]), length


def test_an_intact_checkpoint_loads_and_a_missing_one_is_an_os_error(saved, tmp_path):
    path = tmp_path / "intact.pt"
    path.write_bytes(saved)
    loaded = checkpoint.load(path)
    assert torch.equal(loaded["w"], STATE["w"]) and loaded["step"] == 3
    with pytest.raises(FileNotFoundError):
        checkpoint.load(tmp_path / "absent.pt")
