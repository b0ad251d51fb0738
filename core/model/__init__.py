"""The model contract plugins implement (``model_api``), reading Hugging Face checkpoint folders
(``checkpoint``) and building a runnable model from a configuration (``model_loader``).
"""
