"""Pictures of what a model does: attention maps (attention.py) and the
positional encodings (positional.py), behind `flashformer viz`."""
