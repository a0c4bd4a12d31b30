import os
import signal
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
warnings.filterwarnings("ignore", module="torchrec")


def ctrl_c_as_in_a_terminal() -> None:
    """``preexec_fn`` of a command a test stops with SIGINT: Ctrl-C as in a terminal. A process started with
    SIGINT ignored (tests run in the background, as CI runs them) passes that on, and Python then never
    raises KeyboardInterrupt: the command trains on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not beside the repository")
    return SHARED_DATA
