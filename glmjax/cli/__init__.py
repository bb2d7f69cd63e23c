"""Command-line programs (pyproject.toml [project.scripts]): glmjax-train (`train`), glmjax-generate (`generate`),
glmjax-hf (`hf`), glmjax-eval (`eval`)."""
