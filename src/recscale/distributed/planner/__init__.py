"""The learned embedding sharding planner (NeuroShard): table features, measured cost models, search."""
