"""DFLASH draft recipes: which training recipe gives the draft that greedy serving accepts most.

The DFLASH draft of ``bench/speculative`` (``--draft dflash``) is judged there by one served
run; a recipe question (how many layers, which target layers it reads, how many teacher
windows, the learning rate, weight decay) needs several drafts on the same target. This
benchmark trains ``bench/speculative``'s small target and its teacher continuations once (that
benchmark's code, the same defaults), then one DFLASH draft per ``--recipes`` entry, each for
the same seconds (``--recipe-s``), and judges each offline with ``dflash_heldout``:

- the held-out serving walk: the target's greedy continuations of held-out prompts, walked
  as greedy speculation walks them (each block anchored after the previous block's accepted
  drafts), giving accepted drafts per block. On the H100 runs of ``bench/speculative`` the walk
  ranked drafts as the served c = 1 runs did (run 2: 1.72, run 3: 1.55 walked; run 3 served
  2.30 on a mix of base and adapted requests);
- top-1 agreement per block position on random held-out anchors, and on training blocks
  (their gap is how much the draft memorised its training windows).

Every recipe sees the same held-out continuations, so the comparison is paired.

    python bench/dflash_recipes --smoke
    python bench/dflash_recipes --out $OUT/recipes.md --recipe-s 60 \\
        --recipes "layers=3,ids=reference;layers=3,ids=top;layers=3,ids=top,teacher=24576"
"""
