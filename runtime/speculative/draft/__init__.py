"""What every draft model beside the target shares: its settings (:mod:`.settings`)."""
