"""The BufferManager seam (``buffer_manager``: who owns which pages and state slots), what models
declare they need (``buffer_specs``), the memory plan that sizes it (``memory_plan``, ``rank_plan``) and the
device side (``device_buffers``, ``decode_buffers``).
"""
