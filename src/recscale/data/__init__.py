"""Data: schema, readers, preprocessing, synthetic data, batches and loaders. Knows nothing of models."""
