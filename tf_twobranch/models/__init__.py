"""The model families: two-branch networks (`two_branch`), the dual path (`dual_path`) and deep fragment embeddings (`fragment_embedding`)."""
