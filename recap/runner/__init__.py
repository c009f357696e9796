"""Model runner: the only place that turns scheduler decisions into tensors."""
