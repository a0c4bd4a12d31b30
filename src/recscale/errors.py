"""User-facing errors: the CLI prints these as one line and exits non-zero, no traceback."""

# A training's options as its messages name them: Trainer(cfg, run_dir, resume) and `recscale train` share
# those messages, and each caller knows its options by its own names.
RESUME = "resume=True (CLI: --resume)"
RUN_DIR = "run_dir (CLI: --out)"


class RecscaleError(Exception):
    """A mistake the user can fix: the message says what was wrong, where, and how to fix it."""


class DataError(RecscaleError):
    """Bad input data: missing/empty file, malformed row, bad label or dense value."""


class ConfigError(RecscaleError):
    """An invalid config key, type or value."""


class CheckpointError(RecscaleError):
    """A missing, incomplete, truncated or tampered checkpoint or artifact."""


class StaleArtifactError(CheckpointError):
    """A saved artifact (e.g. preprocess.json) was built from other inputs than the ones given now."""


class ResourceError(RecscaleError):
    """The job does not fit the machine, e.g. its tables do not fit a process's memory."""


class Terminated(BaseException):
    """SIGTERM, raised where a command that asks for it is (``recscale train`` in one process), so the command
    unwinds as from Ctrl-C: a write in progress is dropped whole, as a kill would drop it, and the command says
    where it stopped. A BaseException, as KeyboardInterrupt: no ``except Exception`` on the way takes it for a
    failure of its own (a damaged checkpoint, a bad file)."""
