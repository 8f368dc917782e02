"""The folder of generated files deleted or replaced while the cluster's module came from it."""

import pytest

from tests.faults import folders
from tests.faults.staging import check

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def test_a_deleted_folder_neither_stops_training_nor_the_next_compile(cluster, tmp_path):
    row = folders.generated_folder_deleted(cluster, tmp_path)
    assert row.error == "no error" and row.intact and row.usable, row


def test_a_folder_changed_by_another_compile_is_not_reused_unnoticed(cluster, tmp_path):
    check(folders.generated_folder_changed(cluster, tmp_path))
