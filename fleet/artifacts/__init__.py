"""Content-addressed blobs: rollouts' input files and the outputs their attempts collect."""
