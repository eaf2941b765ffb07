"""trinity_trl: Trinity-RFT algorithms for Hugging Face TRL."""

from .tokenizer import hf_tokenizer, tool_chat_template

__version__ = "0.1.0"

__all__ = ["__version__", "hf_tokenizer", "tool_chat_template"]
