"""The ledger: the only code that speaks SQL."""
