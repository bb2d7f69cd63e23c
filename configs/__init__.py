"""ML-collections experiment configs: `python train.py --config=configs/<name>.py [--config.model.x=...]`."""
