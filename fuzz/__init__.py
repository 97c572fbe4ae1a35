"""Fuzzing: hypothesis strategies, campaigns, shrinking and repro files."""
