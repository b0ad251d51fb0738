"""A toy third-party pegainfer plugin: Qwen3 whose logits are multiplied by ``model.logit_scale``."""
