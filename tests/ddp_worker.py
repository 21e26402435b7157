"""Run by tests/test_training.py under torchrun: train a few steps, then save this rank's weights."""

import os
import sys

from safetensors.torch import save_file

from training.config import TrainConfig
from training.train import train

if __name__ == "__main__":
    config, data_dir, out = sys.argv[1:4]
    cfg = TrainConfig.load(config)
    cfg.data.dir = data_dir
    cfg.train.max_steps = 6
    cfg.train.epochs = 10
    result = train(cfg, out)
    rank = os.environ["RANK"]
    save_file(
        {k: v.contiguous() for k, v in result.model.state_dict().items()}, f"{out}/rank{rank}.safetensors"
    )
