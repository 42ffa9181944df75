"""The contract between the operator and the runtime: imported by both, free of torch.

- :mod:`.config`: the typed runtime configuration (one field per setting);
- :mod:`.flags`: the runtime's command line, generated from the fields (both directions);
- :mod:`.capabilities`: what each speculative algorithm can do with LoRA;
- :mod:`.policy`: the one compatibility policy (the webhook and the runtime's start-up);
- :mod:`.catalog`: the adapter catalog the operator writes and every pod reads.

Nothing here may import torch, the model or the engine: the operator's image has none of
them (``tests/packaging/test_contract_imports.py`` holds that).
"""
