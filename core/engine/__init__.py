"""The engine: requests in, a step (plan -> run -> postprocess -> outputs) at a time, outputs out.

``llm_engine`` is the loop, ``async_engine`` its asyncio front for the server, ``llm`` the offline API;
``batch_builder`` turns a step's plan into the executor's batch, ``output_processor`` does the host
bookkeeping after it; ``request``/``request_group``/``request_stream``/``outputs`` are what a request is.
"""
