"""The parts of ``loraserve-distill-draft`` (:mod:`..distill_draft`), one job per module:
:mod:`.corpus` (text files to packed token sequences), :mod:`.models` (the adapted target as
teacher, the draft with a fresh LoRA as student, the vocabulary check, saving and checking
the adapter), :mod:`.objective` (the distillation loss and the held-out measures),
:mod:`.train` (the optimisation loop and the learning-rate schedule) and :mod:`.report`
(the printed summary and distill_report.json).

New drafts (``--new``, :mod:`.new_draft`), trained from scratch over a frozen target:
:mod:`.eagle_head` / :mod:`.eagle_train` (an EAGLE head), :mod:`.dflash_draft` /
:mod:`.dflash_train` / :mod:`.dflash_recipe` (a DFLASH draft and its training knobs) and
:mod:`.standalone` (a plain Llama distilled from its target). The benchmarks train their
drafts with the same modules."""
