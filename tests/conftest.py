"""Session-wide test settings shared by every suite."""

import os

# Subprocesses started by tests (runtime servers, demos) run `python -m ...`; with the
# repository root as their working directory, the top-level folder operator/ would shadow
# the standard library. PYTHONSAFEPATH keeps the working directory off sys.path.
os.environ.setdefault("PYTHONSAFEPATH", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
