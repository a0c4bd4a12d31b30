"""Model-based retrieval: item indexes inside the model, a seen-item Bloom filter, a two-tower model."""
