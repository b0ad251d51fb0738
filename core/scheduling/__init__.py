"""The Scheduler seam (``scheduler``): which requests prefill how many tokens and which decode, each
step; ``speculative`` verifies, rolls back and proposes the model's own draft tokens.
"""
