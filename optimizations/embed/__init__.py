"""The sentence-embedding runner and its tokenizer segment cache."""
