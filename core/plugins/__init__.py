"""Model plugins: hooks, discovery and the registry (``registry``), the generic tiny-checkpoint
writer plugins build on (``tiny_checkpoints``) and the embedded demos (``demo``).
"""
