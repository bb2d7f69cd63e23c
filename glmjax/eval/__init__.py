"""Evaluation: long-context retrieval tasks (retrieval.py)."""
