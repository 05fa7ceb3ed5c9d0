"""Watching runs: the driver's live progress display and reading finished or running runs."""
