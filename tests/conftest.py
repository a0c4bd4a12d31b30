import os
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
warnings.filterwarnings("ignore", module="torchrec")


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside the repository")
    return SHARED_DATA


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """For pytest-xdist's ``--dist loadgroup`` (``make test``): a module's tests run on one worker, so its
    module-scoped fixtures are built once; test_distributed's tests that do not read its shared launch
    (``runs``) each start their own processes and may run on any worker."""
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        if module == "test_distributed" and "runs" not in getattr(item, "fixturenames", ()):
            continue
        item.add_marker(pytest.mark.xdist_group(module))
