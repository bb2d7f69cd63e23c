"""Data: tokenizers (bytes, or a checkpoint's Hugging Face tokenizer), document sources (files of several formats or
the embedded stdlib corpus; text, SFT pairs, chat conversations, pre-tokenized records), packing, and the grain
pipeline the trainer uses (`make_pipeline`). Fields and rules: docs/data.md."""
from glmjax.data.hf_tokenizer import HFTokenizer
from glmjax.data.packing import Block
from glmjax.data.pipeline import Pipeline, default_data_config, make_pipeline, validate_data_config
from glmjax.data.pretokenized import write_tokens
from glmjax.data.sources import Source, open_source
from glmjax.data.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer

__all__ = ["Block", "ByteTokenizer", "HFTokenizer", "Pipeline", "Source", "Tokenizer", "default_data_config",
           "make_pipeline", "make_tokenizer", "open_source", "validate_data_config", "write_tokens"]
