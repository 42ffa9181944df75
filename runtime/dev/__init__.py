"""Development assets, not the serving core: tiny random models and adapters for tests
(:mod:`.devmodels`), the real SmolLM2 model and adapters trained on it (:mod:`.realmodel`),
and the demo (``python -m loraserve.runtime.dev.demo``, run by ``make demo``)."""
