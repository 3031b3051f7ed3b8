"""Opens the dataset a config's `data` section names."""

from __future__ import annotations

from omegaconf import DictConfig

from tasks.arithmetic import ArithmeticTask
from tasks.base import Dataset
from tasks.jsonl import JsonlDataset


def open_dataset(data: DictConfig, seed: int) -> Dataset:
    if data.source == "arithmetic":
        return ArithmeticTask(seed=seed, max_ops=data.max_ops, max_operand=data.max_operand,
                              tail_exponent=data.tail_exponent, size=data.size)
    return JsonlDataset(data.source, seed=seed)
