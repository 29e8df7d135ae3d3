"""bert_fast bounds oneDNN's shape-keyed caches at import (bert_fast/onednn_caches.py, #32 item 7), and
a value the user set wins. Each case imports bert_fast in a fresh process: the setting only means
something before the first oneDNN op of the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from bert_fast import onednn_caches

PROBE = "import json, os, bert_fast; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"


def _child_env(extra: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in onednn_caches.VARIABLES}
    env.update(extra)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(names=list(onednn_caches.VARIABLES))],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_import_bounds_both_caches_where_unset():
    seen = _child_env({})
    assert seen == {name: str(onednn_caches.CAPACITY) for name in onednn_caches.VARIABLES}


def test_a_value_in_the_environment_wins():
    seen = _child_env({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"})
    assert seen["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "1024"
    assert seen["LRU_CACHE_CAPACITY"] == str(onednn_caches.CAPACITY)


def test_bound_reports_what_is_in_force(monkeypatch):
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    assert onednn_caches.bound() == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "7", "LRU_CACHE_CAPACITY": "64"}
