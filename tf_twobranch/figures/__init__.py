"""Figures of the papers, drawn from runs and exports (no flags)."""
