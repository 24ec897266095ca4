import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests import tiny_models directly


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models on a shared 2-core machine: extra intra-op threads only add contention."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny Llama converted to ELN and saved once a module; the fault tests copy it before tampering."""
    import hf_normswap
    from tiny_models import tiny_model

    model = tiny_model("llama")
    hf_normswap.convert(model, to="eln", input_scale=1.0)  # the theory's start: one shape parameter a module
    directory = tmp_path_factory.mktemp("converted") / "llama-eln"
    hf_normswap.save_pretrained(model, directory)
    return directory


@pytest.fixture
def no_loading(monkeypatch):
    """The recipe stops where it would load the first model: what happens before is what these tests check."""
    from hf_normswap.training import recipe

    def loaded(*args, **kwargs):
        raise RuntimeError("a model was loaded")

    monkeypatch.setattr(recipe, "load_models", loaded)
    return recipe
