"""Development demos of the operator (not imported by the operator itself)."""
