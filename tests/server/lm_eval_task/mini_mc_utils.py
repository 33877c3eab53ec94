"""Loads the local question file for the moeserve_mini_mc lm-eval task (no network)."""

import json
import os

import datasets


def load(**kwargs):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mini_mc.jsonl")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
