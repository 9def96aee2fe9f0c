"""Readers and writers, one module per on-disk format."""
