"""Shared fixtures: the trained demo pair the repository ships (``models/demo``), so the suite runs
the same on a user's fresh clone as in CI (neither depends on anything outside the repository).

The tests of the pure core (``specinfer.core``) need no torch, and this file keeps it so: torch
is optional here and everything built on it (transformers, the models) is imported inside the
fixtures that use it. ``tests/test_torch_free.py`` runs those tests where ``import torch`` fails.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import torch
except ImportError:  # only the pure core's tests can run then
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads this when it is imported (transformers imports it), so set it first: without
    # a GPU, kernels run under the Triton interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# float32 is the exactness oracle: services the tests start (and the CLI's generate) would
# otherwise run in --dtype auto, which is bfloat16 on a machine with AVX512-BF16 or AMX.
os.environ.setdefault("SPECINFER_DTYPE", "float32")
if torch is not None:
    # under pytest-xdist (scripts/test.sh) the workers share the cores: each gets its part, so that
    # torch's thread pools do not spin against each other
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))


def pytest_collection_finish(session: pytest.Session) -> None:
    """Every test module is imported (torch, transformers, ...): their ~200k objects leave the garbage collector's
    view (``gc.freeze``), so that its full collections, which the statistical tests' many small objects trigger,
    stop rescanning them (~50 ms each), as the services do once they serve (``specinfer.serving.server``)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


REPO = Path(__file__).resolve().parents[1]
# The bundled demo pair (trained by `specinfer train-demo`: a 4-layer LLM, three SSMs). Another
# pair with the same layout (llm/, ssm/, prompts.jsonl) may be named for a local run.
TEST_PAIR = Path(os.environ.get("SPECINFER_TEST_MODELS", REPO / "models/demo"))


@dataclass(frozen=True)
class ModelPair:
    llm: Path
    ssm: Path
    ssm2: Path  # a second, different SSM for merge tests
    prompts: list[list[int]]  # token IDs


def _prompt_ids(pair: Path) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(pair / "llm/tokenizer.json"))
    lines = (pair / "prompts.jsonl").read_text().splitlines()
    return [tok.encode(json.loads(line)["text"]).ids for line in lines]


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory) -> ModelPair:
    """LLM, SSM and a second SSM (the LLM cut to its first layers), with prompts."""
    import torch
    from transformers import AutoModelForCausalLM

    from specinfer.models.tiny import truncated_copy

    if not (TEST_PAIR / "llm/config.json").is_file():
        raise FileNotFoundError(
            f"no test pair at {TEST_PAIR} (SPECINFER_TEST_MODELS names a folder with llm/, ssm/, prompts.jsonl)"
        )
    big = AutoModelForCausalLM.from_pretrained(str(TEST_PAIR / "llm"), dtype=torch.float32)
    ssm2 = tmp_path_factory.mktemp("pair") / "ssm2"
    truncated_copy(big, 2).save_pretrained(ssm2)
    return ModelPair(TEST_PAIR / "llm", TEST_PAIR / "ssm", ssm2, _prompt_ids(TEST_PAIR))


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory):
    """The cost calibrations of this run's engines and services in a folder of the run, not the user's
    cache: a stack started after the first finds its calibration there, and nothing outlives the run."""
    folder = tmp_path_factory.mktemp("calibration")
    saved = os.environ.get("SPECINFER_CALIBRATION_CACHE")
    os.environ["SPECINFER_CALIBRATION_CACHE"] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop("SPECINFER_CALIBRATION_CACHE", None)
    else:
        os.environ["SPECINFER_CALIBRATION_CACHE"] = saved


@pytest.fixture
def restore_logging():
    """main() installs its JSON log handler on the root logger; put pytest's back afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


@pytest.fixture(scope="session", autouse=True)
def stacks_on_a_redis_cluster(tmp_path_factory):
    """With ``SPECINFER_TEST_REDIS_CLUSTER=1``, every stack the tests start keeps its requests in one
    real 3-master, 3-replica Redis Cluster (tests/redis_cluster.py) with replica-acknowledged writes,
    instead of each request manager's embedded Redis: the request managers read the cluster from
    their environment, and each stack gets its own key prefix (``SPECINFER_REDIS_KEY_PREFIX``), so no
    stack sees (resumes, adopts) another's requests. CI runs the end-to-end and fault suites so."""
    if os.environ.get("SPECINFER_TEST_REDIS_CLUSTER") != "1":
        yield None
        return
    import dataclasses

    from redis_cluster import LocalRedisCluster  # tests/redis_cluster.py

    from specinfer.launcher import Stack

    settings = {"SPECINFER_REDIS_CLUSTER": "on", "SPECINFER_REDIS_MIN_REPLICA_ACKS": "1"}
    start = Stack.start

    def start_on_the_cluster(self, *args, **kwargs):
        prefix = ("SPECINFER_REDIS_KEY_PREFIX", f"t-{self.workdir.name}")
        self.config = dataclasses.replace(self.config, extra_env=(*self.config.extra_env, prefix))
        return start(self, *args, **kwargs)

    with LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as cluster:
        saved = {k: os.environ.get(k) for k in (*settings, "SPECINFER_REDIS_URL")}
        os.environ.update(settings, SPECINFER_REDIS_URL=cluster.url)
        Stack.start = start_on_the_cluster
        try:
            yield cluster
        finally:
            Stack.start = start
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
