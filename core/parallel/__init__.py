"""Tensor parallelism as model layers see it: ``distributed`` (a rank's group and collectives) and
``sharding`` (which part of a checkpoint tensor a rank reads).
"""
