"""Shared fixtures: a clean override variable and a throwaway pass namespace per test."""

from __future__ import annotations

import itertools
import os

import pytest
from coremltools.converters.mil.mil.passes.pass_registry import PASS_REGISTRY

import generic_passes  # noqa: F401  (registers the project's passes once)
from pattern_infra import ENV_VAR
from pattern_infra import generic_passes as generic_passes_registered
from pattern_infra.testing.vision import install_torchvision_shim

# torchvision's wheel does not import beside the CPU torch without it, nor then does transformers, which
# imports torchvision whenever it is installed (see pattern_infra/testing/vision.py).
install_torchvision_shim()

_counter = itertools.count()


@pytest.fixture(autouse=True, scope="session")
def _torch_converters():
    """The converters of ``pattern_infra.pytorch.torch_support``, as a user converting PyTorch models
    installs them (coremltools 8.3 needs one for every ``.to(dtype)``; tests of the converters take them
    out again)."""
    from pattern_infra.pytorch import torch_support

    torch_support.install()


@pytest.fixture(autouse=True)
def _no_override_leak():
    """Every test starts with the override unset and leaves it as it found it."""
    previous = os.environ.pop(ENV_VAR, None)
    yield
    os.environ.pop(ENV_VAR, None)
    if previous is not None:
        os.environ[ENV_VAR] = previous


@pytest.fixture
def namespace():
    """A fresh namespace for passes registered by one test; removed from the registry afterwards."""
    name = f"t{next(_counter)}"
    yield name
    for pass_id in [k for k in PASS_REGISTRY.passes if k.startswith(f"{name}::")]:
        del PASS_REGISTRY.passes[pass_id]
    for container in generic_passes_registered().values():
        container.followers = [f for f in container.followers if not f.pass_id.startswith(f"{name}::")]


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """A PyTorch pre-norm transformer (2 layers: 5 written-out layer norms) converted without the
    override and saved as an .mlpackage with metadata; with its PyTorch output and the op counts of a
    conversion with the override on. For the command-line and report tests."""
    pytest.importorskip("torch")

    from pattern_infra.cli.mlpackage import op_histogram
    from pattern_infra.testing import models
    from pattern_infra.testing.convert import convert_torch, convert_torch_model

    module, args = models.prenorm_transformer()
    mlmodel = convert_torch_model(module, args, override=False)
    mlmodel.author = "test author"
    mlmodel.user_defined_metadata["origin"] = "tests/test_cli.py"
    path = tmp_path_factory.mktemp("models") / "transformer.mlpackage"
    mlmodel.save(str(path))
    with_override = convert_torch(module, args, override=True)
    expected = module(*args).detach().numpy()
    return {"path": path, "args": args, "torch": expected, "override_counts": op_histogram(with_override)}


def pytest_addoption(parser):
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run tests marked slow (the whole transformers zoo; `make models` does)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow (make models)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


SHADOW_ENV_VAR = "PATTERN_INFRA_SHADOW_LAYERNORM"
"""``PATTERN_INFRA_SHADOW_LAYERNORM=<log file>``: every run of ``common::fuse_layernorm_or_instancenorm``
in the session (pass tests, coremltools' suite, whole conversions) also runs the pass as it was before
it was written with ``one_of`` (``tests/passes/layernorm_reference.py``) on a copy and compares the
printed programs; a difference fails the test, every comparison is logged (see
``tests/passes/test_layernorm_rewrite.py``)."""


def pytest_configure(config):
    log = os.environ.get(SHADOW_ENV_VAR)
    if log:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent / "passes"))
        import layernorm_reference

        layernorm_reference.shadow(PASS_REGISTRY.passes["common::fuse_layernorm_or_instancenorm"], log)
