"""What a run reports: metrics lines, the run's history, TensorBoard, memory figures, and the
writer that puts report lines on disk off the training step."""
