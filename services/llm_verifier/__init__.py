"""LLM verifier: serves ``specinfer.v1.LlmVerifier``, verifying draft trees with the LLM."""
