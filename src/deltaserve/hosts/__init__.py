"""Hosts: inference engines DeltaServe attaches to. Each imports its engine lazily."""
