"""The Executor seam (``executor``) and what runs under it: one ``model_runner`` per tensor-parallel
rank (device buffers, CUDA graphs, sampling), ``tp_executor``/``tp_launch``/``tp_worker`` for several ranks
and ``step_channel``/``step_message`` for what rank 0 sends them each step.
"""
