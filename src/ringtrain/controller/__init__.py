"""Driver-side state machine and policies."""
