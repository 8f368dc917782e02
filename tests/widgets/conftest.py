"""The one-process run the chart and report tests read, made once per test session."""

import pytest

from tests.widgets.compiled import gpt_pipeline_run


@pytest.fixture(scope="session")
def run(tmp_path_factory):
    """``gpt_pipeline_run``'s plan, measured timeline and memory: the tests only read them."""
    return gpt_pipeline_run(str(tmp_path_factory.mktemp("gen")))
