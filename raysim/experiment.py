"""From a resolved config to what a run needs, with every data-dependent check done
before anything is written: the dataset, its partition, the model's fit, the run dir."""
from __future__ import annotations

import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from raysim.config import ConfigError, augmentation_name
from raysim.data.datasets import FederatedData, load_dataset, num_classes
from raysim.data.partition import Partition, make_partition
from raysim.models import build_model


def prepare(cfg: DictConfig) -> tuple[FederatedData, Partition, int]:
    """Load the dataset, partition it and check that the model accepts its inputs."""
    data = load_dataset(cfg)
    aug = augmentation_name(cfg.local.augment)
    if aug == "colour" and (data.norm is None or len(data.input_shape) != 3 or data.input_shape[0] != 3):
        raise ConfigError(f"local.augment={cfg.local.augment} (colour) needs colour images (cifar10, cifar100, svhn, "
                          f"cinic10); dataset {cfg.dataset!r} has inputs {data.input_shape}")
    if aug == "crop_flip" and (len(data.input_shape) != 3 or min(data.input_shape[1:]) <= 4):
        raise ConfigError(f"local.augment=crop_flip needs images larger than 4x4; dataset {cfg.dataset!r} has "
                          f"inputs {data.input_shape}")
    n_classes = num_classes(cfg)
    part = make_partition(data.y_train, cfg, n_classes, data.users_train)
    try:
        model = build_model(cfg.model, data.input_shape, n_classes)
        with torch.no_grad():
            model.eval()(torch.zeros(2, *data.input_shape))
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"model={cfg.model!r} does not fit dataset {cfg.dataset!r} with inputs "
                          f"{data.input_shape}: {str(e).splitlines()[0]}") from None
    return data, part, n_classes


def run_dir_for(cfg: DictConfig) -> Path:
    """`output_dir/run_name` (default name: algorithm-dataset-timestamp); must not exist."""
    name = cfg.run_name or f"{cfg.algorithm}-{cfg.dataset}-{time.strftime('%Y%m%d-%H%M%S')}"
    out = Path(cfg.output_dir)
    for folder in (out, *out.parents):  # the nearest part of output_dir that exists must be a folder
        if folder.exists():
            if not folder.is_dir():
                raise ConfigError(f"output_dir={cfg.output_dir!r}: {folder} is a file, not a folder; "
                                  "choose another output_dir")
            break
    run_dir = out / name
    if run_dir.exists():
        raise ConfigError(f"run directory {run_dir} already exists; choose another run_name or output_dir")
    return run_dir
