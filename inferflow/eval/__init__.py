"""Model evaluation tools (perplexity)."""
