"""Hydra configuration of the toy plugin (found through pkg://pegainfer_toy.conf)."""
