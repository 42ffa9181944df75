"""``python bench/dflash_recipes ARGS``: the DFLASH recipe study (the package docstring says what it does)."""

import runpy
from pathlib import Path

if __name__ == "__main__":
    bootstrap = runpy.run_path(str(Path(__file__).resolve().parents[1] / "bootstrap.py"))
    bootstrap["main"](__file__, "study", env={"TOKENIZERS_PARALLELISM": "true"})
