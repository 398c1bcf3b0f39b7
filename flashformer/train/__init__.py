"""Training: the run's settings (config.py), the loop that runs any objective (trainer.py), the
corpora and token files (corpus.py), the language-modelling objective of `flashformer train`
(language_modeling.py), a run's data folder (run_folder.py) and its loss curves (loss_plot.py)."""

from flashformer.train.config import TrainConfig
from flashformer.train.trainer import Trainer

__all__ = ["TrainConfig", "Trainer"]
