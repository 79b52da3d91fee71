"""specinfer: tree-based speculative inference and verification for LLM serving."""
