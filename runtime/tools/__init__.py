"""Command-line tools shipped in the serving image beside the runtime: the init container's
model and adapter fetcher (:mod:`.fetch`, ``loraserve-fetch``) and the draft-vocabulary token
map builder (:mod:`.token_map`, ``loraserve-token-map``)."""
