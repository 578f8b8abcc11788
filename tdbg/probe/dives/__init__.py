"""Deep dives in the training process: profiler, memory snapshot, NaN hunt, anomaly, activations."""
