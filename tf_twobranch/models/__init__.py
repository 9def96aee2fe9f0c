"""The model families: two-branch networks (`two_branch`) and the dual path (`dual_path`)."""
