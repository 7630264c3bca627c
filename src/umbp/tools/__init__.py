"""Layer 4: the `umbp` command's tools (bench, demo, explain, ...)."""
