"""A disk that fills, and checkpoints damaged on it: the error names the rank and the file, and
what was there before is still whole."""

import pytest

from tests.faults import disks
from tests.faults.staging import check

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def test_a_disk_full_in_a_checkpoint_save_keeps_the_previous_checkpoints(cluster, tmp_path):
    check(disks.disk_full_in_checkpoint_save(cluster, tmp_path))


def test_a_disk_full_in_a_write_of_generated_files_keeps_the_previous_folder(cluster, tmp_path):
    row = disks.disk_full_in_generated_files(cluster, tmp_path)
    if row.error == "not staged":
        pytest.skip(row.note)
    check(row)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_a_damaged_checkpoint_is_refused_naming_the_rank_and_the_file(cluster, tmp_path, damage):
    check(disks.damaged_checkpoint(cluster, tmp_path, damage))
