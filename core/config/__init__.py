"""Configuration: the validated schema (``schema``) and Hydra composition (``compose``)."""
