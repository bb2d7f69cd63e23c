"""Command-line tools: `python -m glmjax.tools.topk_overlap`."""
