"""Data: tokenizers, document sources (files of several formats or the embedded stdlib corpus), packing, and the
grain pipeline the trainer uses (`make_pipeline`)."""
from glmjax.data.packing import Block
from glmjax.data.pipeline import Pipeline, default_data_config, make_pipeline, validate_data_config
from glmjax.data.sources import Source, open_source
from glmjax.data.tokenizer import ByteTokenizer, Tokenizer, make_tokenizer

__all__ = ["Block", "ByteTokenizer", "Pipeline", "Source", "Tokenizer", "default_data_config", "make_pipeline",
           "make_tokenizer", "open_source", "validate_data_config"]
