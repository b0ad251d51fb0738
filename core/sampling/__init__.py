"""Sampling: what a user asks (``sampling_params``) and the batched sampler that does it (``sampler``)."""
