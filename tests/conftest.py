import os
import sys

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
    import pytest

    if os.environ.get("OVERLAP_TEST_NCCL_RULES") != "1":
        return
    for item in items:
        marker = item.get_closest_marker("gloo_only")
        if marker is not None:
            item.add_marker(
                pytest.mark.skip(reason=f"gloo only: {marker.kwargs.get('reason', '')}")
            )
