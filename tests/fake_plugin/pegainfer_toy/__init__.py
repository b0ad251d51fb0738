"""A toy third-party pegainfer plugin, written against the public plugin API alone: a compact Qwen3 whose
logits are multiplied by ``model.logit_scale``."""
