"""Tools beside the training path: benchmarks and measurements a reader of the trainer need not meet."""
