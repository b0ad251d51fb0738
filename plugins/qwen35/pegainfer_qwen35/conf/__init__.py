"""Hydra configuration shipped inside the package (found through pkg://)."""
