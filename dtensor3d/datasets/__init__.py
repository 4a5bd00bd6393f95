"""Data: token sources (synthetic, token files, prepared token directories) and prepare-data."""
