"""Trace replay, the compared systems, metrics and the evaluation report."""
