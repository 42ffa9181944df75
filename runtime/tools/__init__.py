"""Command-line tools shipped beside the runtime, not part of the serving core: the init
container's model and adapter fetcher (:mod:`.fetch`, ``loraserve-fetch``), the
draft-vocabulary token map builder (:mod:`.token_map`, ``loraserve-token-map``) and the draft
adapter distiller (:mod:`.distill_draft`, ``loraserve-distill-draft``; needs peft)."""
