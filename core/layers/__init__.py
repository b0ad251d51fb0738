"""Shared building blocks of the model plugins, each a torch reference (the oracle for fast kernels)."""
