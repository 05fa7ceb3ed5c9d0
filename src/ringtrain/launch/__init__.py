"""Launchers: how worker processes start."""
