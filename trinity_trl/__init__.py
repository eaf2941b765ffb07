"""trinity_trl: Trinity-RFT algorithms for Hugging Face TRL."""
__version__ = "0.1.0"
