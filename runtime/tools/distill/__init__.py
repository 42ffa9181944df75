"""The parts of ``loraserve-distill-draft`` (:mod:`..distill_draft`), one job per module:
:mod:`.corpus` (text files to packed token sequences), :mod:`.models` (the adapted target as
teacher, the draft with a fresh LoRA as student, the vocabulary check, saving and checking
the adapter), :mod:`.objective` (the distillation loss and the held-out measures),
:mod:`.train` (the optimisation loop) and :mod:`.report` (the printed summary and
distill_report.json)."""
