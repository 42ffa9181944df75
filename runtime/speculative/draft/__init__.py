"""What every draft model beside the target shares: its settings (:mod:`.settings`, built
once by the factory), its runner's KV cache, weights and context buckets (:mod:`.runner`),
and its graph runner's base (:mod:`.graphs`)."""
