"""Distributed: process groups and topology, sharding, checkpoints. Wraps models without them knowing."""
