import os
import sys
import tempfile

import pytest

# Tests import helpers as `tests.world`; spawned ranks need the repository root on their path too.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "gloo_only(reason): measures gloo's own behaviour (the host clock, a modelled link, the "
        "memory a gloo send holds); skipped under OVERLAP_TEST_NCCL_RULES=1",
    )


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("OVERLAP_TEST_NCCL_RULES") != "1":
        return
    for item in items:
        marker = item.get_closest_marker("gloo_only")
        if marker is not None:
            item.add_marker(
                pytest.mark.skip(reason=f"gloo only: {marker.kwargs.get('reason', '')}")
            )


@pytest.fixture(scope="session", autouse=True)
def _temporary_files_under_pytest(tmp_path_factory):
    """A failed `overlap run` keeps its rank logs in `$TMPDIR/overlap-run-*` (by design: its error
    names them). The suite fails runs on purpose, about 40 a session: their logs, and every other
    temporary file of the suite's processes, go under pytest's own temporary folder (which pytest
    prunes to its last three sessions) rather than piling up in /tmp."""
    before = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmpdir"))
    tempfile.tempdir = None  # this process's tempfile re-reads TMPDIR
    yield
    if before is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
