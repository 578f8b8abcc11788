"""The training thread's side of the probe: hooks, taps and the per-step sampler."""
