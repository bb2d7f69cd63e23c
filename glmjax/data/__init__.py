"""Data: byte tokenizer, text sources (the embedded stdlib corpus, text / JSONL files), packing into batches."""
from glmjax.data.corpus import Corpus, load_corpus
from glmjax.data.packing import Packer, pack_rows, split_documents
from glmjax.data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "Corpus", "Packer", "load_corpus", "pack_rows", "split_documents"]
