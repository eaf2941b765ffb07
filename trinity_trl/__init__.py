"""trinity_trl: Trinity-RFT algorithms for Hugging Face TRL."""

from .distributed import end_process_group, ending_process_group
from .tokenizer import hf_tokenizer, tool_chat_template

__version__ = "0.1.0"

__all__ = ["__version__", "end_process_group", "ending_process_group", "hf_tokenizer", "tool_chat_template"]
